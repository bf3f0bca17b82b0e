//! Kubernetes resource quantities (`1Gi`, `500M`, `1.5G`, `1e9`) read as a whole number of
//! bytes, for the sizes operators and pods write the way they write them in a pod spec (an
//! emptyDir's `sizeLimit`, copied into an annotation; the shim config's defaults).
//!
//! The grammar is Kubernetes' own (`k8s.io/apimachinery/pkg/api/resource`): a decimal number,
//! optionally with a fraction, then a binary suffix (`Ki` .. `Ei`), a decimal suffix (`k`, `M`,
//! `G`, `T`, `P`, `E`) or a decimal exponent (`e6`, `E9`). A fractional byte count rounds up, as
//! `Quantity.Value()` does. Stricter than Kubernetes where a size makes no sense: no sign, no
//! milli suffix (`500m` is half a byte), no whitespace, at most [`MAX_DIGITS`] digits, and
//! nothing past `u64`. Pure arithmetic in `u128`, every step checked: the input comes from pod
//! annotations, which the pod's author writes.

/// Most digits a quantity may have (integer and fraction together): enough for any byte count a
/// `u64` holds (20 digits), few enough that the arithmetic below cannot overflow `u128`
/// (below 10^20 times at most 2^60 or 10^18).
pub const MAX_DIGITS: usize = 20;
/// Largest decimal exponent accepted (`1e18` is already an exabyte).
const MAX_EXPONENT: u32 = 18;

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum QuantityError {
    #[error("empty quantity")]
    Empty,
    #[error("{0:?} is not a Kubernetes quantity (a number with an optional suffix: Ki, Mi, Gi, Ti, Pi, Ei, k, M, G, T, P, E, or an exponent such as e9)")]
    Syntax(String),
    #[error("{0:?}: a size cannot be negative")]
    Negative(String),
    #[error("{0:?}: the milli suffix `m` names fractions of a byte")]
    Milli(String),
    #[error("{0:?} has more than {MAX_DIGITS} digits")]
    TooManyDigits(String),
    #[error("{0:?} is larger than {max} bytes", max = u64::MAX)]
    TooLarge(String),
}

/// A suffix's value as `numerator / denominator`.
fn suffix_scale(suffix: &str, text: &str) -> Result<(u128, u128), QuantityError> {
    let binary = |shift: u32| Ok((1u128 << shift, 1));
    let decimal = |exp: u32| Ok((10u128.pow(exp), 1));
    match suffix {
        "" => decimal(0),
        "Ki" => binary(10),
        "Mi" => binary(20),
        "Gi" => binary(30),
        "Ti" => binary(40),
        "Pi" => binary(50),
        "Ei" => binary(60),
        "k" => decimal(3),
        "M" => decimal(6),
        "G" => decimal(9),
        "T" => decimal(12),
        "P" => decimal(15),
        "E" => decimal(18),
        "m" => Err(QuantityError::Milli(text.into())),
        other => {
            let Some(exponent) = other.strip_prefix(['e', 'E']) else {
                return Err(QuantityError::Syntax(text.into()));
            };
            let (negative, digits) = match exponent.as_bytes().first() {
                Some(b'-') => (true, &exponent[1..]),
                Some(b'+') => (false, &exponent[1..]),
                _ => (false, exponent),
            };
            if digits.is_empty() || digits.len() > 2 || !digits.bytes().all(|b| b.is_ascii_digit()) {
                return Err(QuantityError::Syntax(text.into()));
            }
            let exp: u32 = digits.parse().map_err(|_| QuantityError::Syntax(text.into()))?;
            if exp > MAX_EXPONENT {
                return Err(QuantityError::TooLarge(text.into()));
            }
            Ok(if negative { (1, 10u128.pow(exp)) } else { (10u128.pow(exp), 1) })
        }
    }
}

/// Parses a Kubernetes quantity as bytes (module docs), rounding a fraction up.
pub fn parse_bytes(text: &str) -> Result<u64, QuantityError> {
    if text.is_empty() {
        return Err(QuantityError::Empty);
    }
    if text.starts_with('-') {
        return Err(QuantityError::Negative(text.into()));
    }
    let body = text.strip_prefix('+').unwrap_or(text);
    // The number: digits, optionally "." and more digits; at least one digit in all.
    let number_len = body.bytes().take_while(|b| b.is_ascii_digit() || *b == b'.').count();
    let (number, suffix) = body.split_at(number_len);
    let (int, frac) = number.split_once('.').unwrap_or((number, ""));
    if (int.is_empty() && frac.is_empty()) || frac.contains('.') {
        return Err(QuantityError::Syntax(text.into()));
    }
    if int.len() + frac.len() > MAX_DIGITS {
        return Err(QuantityError::TooManyDigits(text.into()));
    }
    let digits = |s: &str| s.bytes().try_fold(0u128, |acc, b| acc.checked_mul(10)?.checked_add(u128::from(b - b'0')));
    let too_large = || QuantityError::TooLarge(text.into());
    // value = (int.frac) * num / den = (int * 10^f + frac) * num / (10^f * den)
    let frac_scale = 10u128.pow(frac.len() as u32);
    let mantissa = digits(int)
        .and_then(|i| i.checked_mul(frac_scale))
        .and_then(|i| i.checked_add(digits(frac)?))
        .ok_or_else(too_large)?;
    let (num, den) = suffix_scale(suffix, text)?;
    let numerator = mantissa.checked_mul(num).ok_or_else(too_large)?;
    let denominator = frac_scale.checked_mul(den).ok_or_else(too_large)?;
    let bytes = numerator.div_ceil(denominator);
    u64::try_from(bytes).map_err(|_| too_large())
}

/// `bytes` the way people read sizes: the largest binary unit it is a whole number of.
pub fn format_bytes(bytes: u64) -> String {
    for (shift, unit) in [(60, "Ei"), (50, "Pi"), (40, "Ti"), (30, "Gi"), (20, "Mi"), (10, "Ki")] {
        if bytes >= 1 << shift && bytes.is_multiple_of(1 << shift) {
            return format!("{}{unit}", bytes >> shift);
        }
    }
    bytes.to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kubernetes_spellings_are_read_as_bytes() {
        for (text, bytes) in [
            ("0", 0),
            ("123", 123),
            ("+5", 5),
            ("1Ki", 1024),
            ("32Mi", 32 << 20),
            ("1Gi", 1 << 30),
            ("2Ti", 2 << 40),
            ("1Pi", 1 << 50),
            ("1Ei", 1 << 60),
            ("500M", 500_000_000),
            ("1k", 1000),
            ("1G", 1_000_000_000),
            ("3T", 3_000_000_000_000),
            ("1P", 1_000_000_000_000_000),
            ("1E", 1_000_000_000_000_000_000),
            ("1.5Gi", 3 << 29),
            ("0.5Ki", 512),
            (".5Ki", 512),
            ("1.", 1),
            ("1e9", 1_000_000_000),
            ("5E6", 5_000_000),
            ("1e+3", 1000),
            ("15e-1", 2),
            ("1.0001", 2),
            ("18446744073709551615", u64::MAX),
        ] {
            assert_eq!(parse_bytes(text), Ok(bytes), "{text}");
        }
    }

    #[test]
    fn malformed_quantities_are_refused_with_the_reason() {
        for (text, want) in [
            ("", QuantityError::Empty),
            ("-1Gi", QuantityError::Negative("-1Gi".into())),
            ("500m", QuantityError::Milli("500m".into())),
            ("1 Gi", QuantityError::Syntax("1 Gi".into())),
            (" 1Gi", QuantityError::Syntax(" 1Gi".into())),
            ("1Gi ", QuantityError::Syntax("1Gi ".into())),
            ("1gi", QuantityError::Syntax("1gi".into())),
            ("1GB", QuantityError::Syntax("1GB".into())),
            ("1K", QuantityError::Syntax("1K".into())),
            ("Gi", QuantityError::Syntax("Gi".into())),
            (".", QuantityError::Syntax(".".into())),
            ("1.2.3", QuantityError::Syntax("1.2.3".into())),
            ("0x10", QuantityError::Syntax("0x10".into())),
            ("1e", QuantityError::Syntax("1e".into())),
            ("1e1.5", QuantityError::Syntax("1e1.5".into())),
            ("1e100", QuantityError::Syntax("1e100".into())),
            ("1e19", QuantityError::TooLarge("1e19".into())),
            ("16Ei", QuantityError::TooLarge("16Ei".into())),
            ("18446744073709551616", QuantityError::TooLarge("18446744073709551616".into())),
            ("123456789012345678901", QuantityError::TooManyDigits("123456789012345678901".into())),
            ("99999999999999999999Ei", QuantityError::TooLarge("99999999999999999999Ei".into())),
            ("0.00000000000000000001e-18", QuantityError::TooManyDigits("0.00000000000000000001e-18".into())),
            ("++1", QuantityError::Syntax("++1".into())),
            ("1Mi\n", QuantityError::Syntax("1Mi\n".into())),
            ("١Gi", QuantityError::Syntax("١Gi".into())),
        ] {
            assert_eq!(parse_bytes(text), Err(want), "{text:?}");
        }
    }

    #[test]
    fn huge_inputs_fail_without_overflow() {
        let long = "9".repeat(10_000);
        assert!(matches!(parse_bytes(&long), Err(QuantityError::TooManyDigits(_))));
        assert!(matches!(parse_bytes("9999999999999999999Ei"), Err(QuantityError::TooLarge(_))));
        // The smallest fraction and the largest scale still round up to a byte.
        assert_eq!(parse_bytes(".00000000000000000001e-18"), Ok(1));
        assert_eq!(parse_bytes("99999999999999999999e-2"), Ok(999_999_999_999_999_999 + 1));
    }

    #[test]
    fn sizes_print_in_their_largest_whole_unit() {
        assert_eq!(format_bytes(32 << 20), "32Mi");
        assert_eq!(format_bytes(3 << 29), "1536Mi");
        assert_eq!(format_bytes(1000), "1000");
        assert_eq!(format_bytes(0), "0");
        assert_eq!(parse_bytes(&format_bytes(5 << 40)), Ok(5 << 40));
    }
}
