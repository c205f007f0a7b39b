//! Bind mounts and `/proc/self/mountinfo`: whether a path is mounted is
//! decided by the mount table, never by whether a directory exists.

use std::ffi::CString;
use std::fs;
use std::io;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

/// One line of `/proc/self/mountinfo`, the fields the plugin needs.
#[derive(Clone, Debug)]
pub struct Mount {
    pub mount_point: PathBuf,
    /// Per-mount options (`rw`/`ro`, ...), not the superblock's.
    pub options: String,
}

impl Mount {
    pub fn read_only(&self) -> bool {
        self.options.split(',').any(|o| o == "ro")
    }
}

/// Undoes the octal escapes (`\040` for a space) the kernel writes into
/// mountinfo paths.
fn unescape(field: &str) -> String {
    let bytes = field.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'\\' && i + 3 < bytes.len() {
            let digits = &bytes[i + 1..i + 4];
            if digits.iter().all(|d| (b'0'..=b'7').contains(d)) {
                let v = digits
                    .iter()
                    .fold(0u32, |acc, d| acc * 8 + u32::from(d - b'0'));
                if let Ok(b) = u8::try_from(v) {
                    out.push(b);
                    i += 4;
                    continue;
                }
            }
        }
        out.push(bytes[i]);
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

fn mounts() -> io::Result<Vec<Mount>> {
    let text = fs::read_to_string("/proc/self/mountinfo")?;
    Ok(text
        .lines()
        .filter_map(|line| {
            let mut fields = line.split(' ');
            let mount_point = fields.nth(4)?;
            let options = fields.next()?;
            Some(Mount {
                mount_point: PathBuf::from(unescape(mount_point)),
                options: options.to_string(),
            })
        })
        .collect())
}

/// The topmost mount at `path`, if `path` is a mount point.
pub fn mount_at(path: &Path) -> io::Result<Option<Mount>> {
    let canonical = fs::canonicalize(path).unwrap_or_else(|_| path.to_path_buf());
    Ok(mounts()?
        .into_iter()
        .rev()
        .find(|m| m.mount_point == canonical || m.mount_point == path))
}

/// Whether two paths name the same file (after a bind mount, the mount
/// point shows the source's inode).
pub fn same_file(a: &Path, b: &Path) -> io::Result<bool> {
    let (a, b) = (fs::metadata(a)?, fs::metadata(b)?);
    Ok(a.dev() == b.dev() && a.ino() == b.ino())
}

fn c_path(path: &Path) -> io::Result<CString> {
    CString::new(path.as_os_str().as_bytes())
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "path contains a NUL byte"))
}

fn check(rc: libc::c_int) -> io::Result<()> {
    if rc == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

/// `mount --bind source target`.
pub fn bind(source: &Path, target: &Path) -> io::Result<()> {
    let (s, t) = (c_path(source)?, c_path(target)?);
    // SAFETY: both strings are valid NUL-terminated C strings that outlive
    // the call; a null fstype and data are allowed for MS_BIND.
    check(unsafe {
        libc::mount(
            s.as_ptr(),
            t.as_ptr(),
            std::ptr::null(),
            libc::MS_BIND,
            std::ptr::null(),
        )
    })
}

/// Makes the bind mount at `target` read-only (a bind mount ignores
/// MS_RDONLY on creation; it takes a remount).
pub fn remount_read_only(target: &Path) -> io::Result<()> {
    let t = c_path(target)?;
    // SAFETY: a valid C string; source, fstype and data may be null for a
    // remount.
    check(unsafe {
        libc::mount(
            std::ptr::null(),
            t.as_ptr(),
            std::ptr::null(),
            libc::MS_REMOUNT | libc::MS_BIND | libc::MS_RDONLY,
            std::ptr::null(),
        )
    })
}

pub fn unmount(target: &Path) -> io::Result<()> {
    let t = c_path(target)?;
    // SAFETY: a valid NUL-terminated C string that outlives the call.
    check(unsafe { libc::umount2(t.as_ptr(), 0) })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unescapes_octal() {
        assert_eq!(unescape(r"/a\040b"), "/a b");
        assert_eq!(unescape(r"/a\134b\011"), "/a\\b\t");
        assert_eq!(unescape(r"/plain"), "/plain");
        assert_eq!(unescape(r"/short\04"), r"/short\04");
    }
}
