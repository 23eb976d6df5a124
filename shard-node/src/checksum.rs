//! CRC32 of whole files: snapshot files and HNSW dumps are checked the same way.

use std::io::Read;
use std::path::Path;

/// (length, crc32) of the file at `path`.
pub fn file_crc32(path: &Path) -> std::io::Result<(u64, u32)> {
    let mut f = std::fs::File::open(path)?;
    let mut h = crc32fast::Hasher::new();
    let mut buf = vec![0u8; 1 << 20];
    let mut len = 0u64;
    loop {
        let n = f.read(&mut buf)?;
        if n == 0 {
            break;
        }
        h.update(&buf[..n]);
        len += n as u64;
    }
    Ok((len, h.finalize()))
}
