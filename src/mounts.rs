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

/// Decodes mountinfo's octal escapes (`\040` for a space, `\011`,
/// `\012`, `\134`).
pub fn unescape(s: &str) -> PathBuf {
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

/// A snapshot of the mount table for many look-ups: a mount point is
/// found through a hash set, so checking every record of a node against
/// the table (a restart with 10,000 mounts) is linear, not one scan of the
/// table per record.
pub struct MountTable {
    entries: Vec<MountEntry>,
    points: std::collections::HashSet<PathBuf>,
}

impl MountTable {
    pub fn read() -> io::Result<MountTable> {
        Ok(MountTable::from_entries(mounts()?))
    }

    pub fn from_entries(entries: Vec<MountEntry>) -> MountTable {
        let points = entries.iter().map(|e| e.mount_point.clone()).collect();
        MountTable { entries, points }
    }

    pub fn is_mount_point(&self, path: &Path) -> bool {
        self.points.contains(path)
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

/// Whether something is mounted on `path`. Asks the kernel about that one
/// path (see `mounted_on`) instead of reading the whole mount table, which
/// costs milliseconds with a few hundred mounts; falls back to mountinfo
/// where openat2(2) is not available.
pub fn is_mount_point(path: &Path) -> io::Result<bool> {
    match mounted_on(path) {
        Some(r) => r,
        None => Ok(MountTable::read()?.is_mount_point(path)),
    }
}

/// openat2(2) of the last component from its parent with RESOLVE_NO_XDEV
/// fails with EXDEV exactly when the lookup would cross into a mount, that
/// is when a mount sits on `path`. The mounted file system itself is never
/// entered, so a dead network server cannot hang the check. None: the
/// kernel (or a seccomp filter) does not offer openat2, or `path` has no
/// parent.
fn mounted_on(path: &Path) -> Option<io::Result<bool>> {
    use std::ffi::CString;
    use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
    use std::os::unix::ffi::OsStrExt;

    let (parent, name) = (path.parent()?, path.file_name()?);
    let parent_c = CString::new(parent.as_os_str().as_bytes()).ok()?;
    let name_c = CString::new(name.as_bytes()).ok()?;
    // SAFETY: open(2) of a NUL-terminated path; the descriptor is owned
    // right below.
    let dirfd = unsafe {
        libc::open(
            parent_c.as_ptr(),
            libc::O_PATH | libc::O_DIRECTORY | libc::O_CLOEXEC,
        )
    };
    if dirfd < 0 {
        let e = io::Error::last_os_error();
        return Some(match e.raw_os_error() {
            Some(libc::ENOENT) | Some(libc::ENOTDIR) => Ok(false),
            _ => Err(e),
        });
    }
    // SAFETY: `dirfd` was just opened and is owned by nobody else.
    let dir = unsafe { OwnedFd::from_raw_fd(dirfd) };
    // SAFETY: open_how is plain data; all-zero is its documented default.
    let mut how: libc::open_how = unsafe { std::mem::zeroed() };
    how.flags = (libc::O_PATH | libc::O_NOFOLLOW | libc::O_CLOEXEC) as u64;
    how.resolve = libc::RESOLVE_NO_XDEV;
    // SAFETY: openat2(2) with a valid directory descriptor, a NUL-terminated
    // name and an open_how of the size passed.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_openat2,
            dir.as_raw_fd(),
            name_c.as_ptr(),
            &how as *const libc::open_how,
            std::mem::size_of::<libc::open_how>(),
        )
    };
    if rc >= 0 {
        // SAFETY: the descriptor openat2 returned, closed once.
        drop(unsafe { OwnedFd::from_raw_fd(rc as libc::c_int) });
        return Some(Ok(false));
    }
    let e = io::Error::last_os_error();
    match e.raw_os_error() {
        Some(libc::EXDEV) => Some(Ok(true)),
        Some(libc::ENOENT) | Some(libc::ENOTDIR) => Some(Ok(false)),
        Some(libc::ENOSYS) | Some(libc::EPERM) | Some(libc::E2BIG) => None,
        _ => Some(Err(e)),
    }
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

    /// The per-path check agrees with mountinfo: a bind mount on a
    /// directory, one on a file, a stacked mount, after unmounting, and
    /// paths that do not exist.
    #[test]
    fn per_path_check_agrees_with_mountinfo() {
        use std::ffi::CString;
        use std::os::unix::ffi::OsStrExt;
        let dir = tempfile::tempdir().expect("tempdir");
        let c = |p: &Path| CString::new(p.as_os_str().as_bytes()).expect("path");
        let bind = |src: &Path, dst: &Path| {
            // SAFETY: mount(2) with NUL-terminated paths and no data.
            let rc = unsafe {
                libc::mount(
                    c(src).as_ptr(),
                    c(dst).as_ptr(),
                    std::ptr::null(),
                    libc::MS_BIND,
                    std::ptr::null(),
                )
            };
            assert_eq!(rc, 0, "bind mount: {}", io::Error::last_os_error());
        };
        let umount = |p: &Path| {
            // SAFETY: umount2(2) of a path we mounted.
            let rc = unsafe { libc::umount2(c(p).as_ptr(), 0) };
            assert_eq!(rc, 0, "umount: {}", io::Error::last_os_error());
        };
        let (src, dst) = (dir.path().join("src"), dir.path().join("dst"));
        let (file_src, file_dst) = (dir.path().join("f.img"), dir.path().join("f.target"));
        std::fs::create_dir(&src).expect("mkdir");
        std::fs::create_dir(&dst).expect("mkdir");
        std::fs::write(&file_src, b"x").expect("write");
        std::fs::write(&file_dst, b"").expect("write");
        let both = |p: &Path| {
            let fast = mounted_on(p)
                .expect("openat2 is available here")
                .expect("check");
            let table = MountTable::read().expect("mountinfo").is_mount_point(p);
            assert_eq!(fast, table, "{}", p.display());
            fast
        };
        assert!(!both(&dst));
        bind(&src, &dst);
        bind(&file_src, &file_dst);
        assert!(both(&dst));
        assert!(both(&file_dst));
        assert!(!both(&src));
        assert!(!both(&dst.join("inside")));
        bind(&src, &dst); // stacked
        umount(&dst);
        assert!(both(&dst), "one of two stacked mounts is still there");
        umount(&dst);
        umount(&file_dst);
        assert!(!both(&dst));
        assert!(!both(&file_dst));
        assert!(!both(&dir.path().join("missing").join("x")));
        assert!(!is_mount_point(&dir.path().join("missing")).expect("check"));
    }
}
