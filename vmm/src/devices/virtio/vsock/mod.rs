pub struct Vsock;
