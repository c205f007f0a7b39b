//! What is mounted, read from `/proc/self/mountinfo` (never inferred from a
//! directory's existence).

use std::io;
use std::path::{Path, PathBuf};

pub const MOUNTINFO: &str = "/proc/self/mountinfo";

/// One line of mountinfo, the fields claimd uses.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MountEntry {
    pub root: PathBuf,
    pub mount_point: PathBuf,
    /// Per-mount options, e.g. "rw,relatime".
    pub options: String,
}

impl MountEntry {
    pub fn read_only(&self) -> bool {
        self.options.split(',').any(|o| o == "ro")
    }
}

/// Decodes mountinfo's octal escapes (`\040` for a space).
fn unescape(s: &str) -> PathBuf {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'\\' && i + 3 < b.len() {
            let oct = &b[i + 1..i + 4];
            if oct.iter().all(|c| (b'0'..=b'7').contains(c)) {
                let v = u16::from(oct[0] - b'0') * 64
                    + u16::from(oct[1] - b'0') * 8
                    + u16::from(oct[2] - b'0');
                out.push((v & 0xff) as u8);
                i += 4;
                continue;
            }
        }
        out.push(b[i]);
        i += 1;
    }
    use std::os::unix::ffi::OsStringExt;
    PathBuf::from(std::ffi::OsString::from_vec(out))
}

pub fn parse_mountinfo(text: &str) -> Vec<MountEntry> {
    text.lines()
        .filter_map(|line| {
            let mut f = line.split(' ');
            let _id = f.next()?;
            let _parent = f.next()?;
            let _dev = f.next()?;
            let root = f.next()?;
            let mount_point = f.next()?;
            let options = f.next()?;
            Some(MountEntry {
                root: unescape(root),
                mount_point: unescape(mount_point),
                options: options.to_string(),
            })
        })
        .collect()
}

/// Every mount of this process's mount namespace.
pub fn mounts() -> io::Result<Vec<MountEntry>> {
    Ok(parse_mountinfo(&std::fs::read_to_string(MOUNTINFO)?))
}

/// A snapshot of the mount table for many look-ups.
pub struct MountTable {
    entries: Vec<MountEntry>,
}

impl MountTable {
    pub fn read() -> io::Result<MountTable> {
        Ok(MountTable { entries: mounts()? })
    }

    pub fn is_mount_point(&self, path: &Path) -> bool {
        self.entries.iter().any(|e| e.mount_point == path)
    }

    /// Mount points at or below `dir`.
    pub fn under(&self, dir: &Path) -> Vec<PathBuf> {
        self.entries
            .iter()
            .filter(|e| e.mount_point.starts_with(dir))
            .map(|e| e.mount_point.clone())
            .collect()
    }
}

pub fn is_mount_point(path: &Path) -> io::Result<bool> {
    Ok(MountTable::read()?.is_mount_point(path))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_lines_and_escapes() {
        let text = "36 35 98:0 /mnt1 /mnt/parent\\040dir rw,noatime master:1 - ext3 /dev/root rw,errors=continue\n\
                    37 35 0:5 / /proc ro,nosuid shared:2 - proc proc rw\n";
        let m = parse_mountinfo(text);
        assert_eq!(m.len(), 2);
        assert_eq!(m[0].mount_point, PathBuf::from("/mnt/parent dir"));
        assert_eq!(m[0].root, PathBuf::from("/mnt1"));
        assert!(!m[0].read_only());
        assert!(m[1].read_only());
    }

    #[test]
    fn octal_escapes() {
        let line = |p: &str| format!("1 2 0:1 / {p} rw - x x rw");
        let mp = |p: &str| parse_mountinfo(&line(p))[0].mount_point.clone();
        assert_eq!(mp(r"/a\040b"), PathBuf::from("/a b"));
        assert_eq!(mp(r"/a\134b\011"), PathBuf::from("/a\\b\t"));
        assert_eq!(mp("/plain"), PathBuf::from("/plain"));
        assert_eq!(mp(r"/short\04"), PathBuf::from(r"/short\04"));
    }

    #[test]
    fn root_is_a_mount_point_here() {
        assert!(is_mount_point(Path::new("/")).expect("mountinfo readable"));
    }
}
