//! Random identifiers (sandbox ids, nonces), from the kernel's CSPRNG. A leaf: it imports
//! nothing of the crate.

/// Random lowercase hex, from the kernel's CSPRNG.
pub fn random_hex(bytes: usize) -> String {
    use std::io::Read;
    let mut buf = vec![0u8; bytes];
    std::fs::File::open("/dev/urandom")
        .and_then(|mut f| f.read_exact(&mut buf))
        .expect("/dev/urandom is readable");
    hex::encode(buf)
}
