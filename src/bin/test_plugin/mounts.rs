//! Bind mounts and `/proc/self/mountinfo`: whether a path is mounted is
//! decided by the mount table, never by whether a directory exists.

use std::ffi::CString;
use std::fs;
use std::io;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::MetadataExt;
use std::path::Path;

/// One line of `/proc/self/mountinfo` (parsed by the agent's own code).
pub use claimd::mounts::MountEntry as Mount;

fn mounts() -> io::Result<Vec<Mount>> {
    claimd::mounts::mounts()
}

/// The topmost mount at `path`, if `path` is a mount point. The kernel is
/// asked about that one path first (`claimd::mounts::is_mount_point`): the
/// mount table, whose reading grows with the node's mounts (1.5 MB with
/// 10,000), is read only when something is mounted there.
pub fn mount_at(path: &Path) -> io::Result<Option<Mount>> {
    let canonical = fs::canonicalize(path).unwrap_or_else(|_| path.to_path_buf());
    // The canonical path has no symbolic link left for the check not to
    // follow. An error (not a directory we can open) leaves it to the table.
    if let Ok(false) = claimd::mounts::is_mount_point(&canonical) {
        return Ok(None);
    }
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

/// Unmounts the topmost mount at `target`; false when nothing is mounted
/// there (the kernel answers EINVAL for a path that is not a mount point,
/// ENOENT or ENOTDIR for one that does not exist). Asks the kernel's mount tree
/// directly, so a teardown costs no read of the whole mount table (which
/// grows with every mounted volume).
pub fn unmount_if_mounted(target: &Path) -> io::Result<bool> {
    match unmount(target) {
        Ok(()) => Ok(true),
        Err(e)
            if matches!(
                e.raw_os_error(),
                Some(libc::EINVAL | libc::ENOENT | libc::ENOTDIR)
            ) =>
        {
            Ok(false)
        }
        Err(e) => Err(e),
    }
}

/// Detaches the topmost mount at `target` at once (MNT_DETACH): the path
/// no longer leads to it, while what is open there stays usable until
/// closed.
pub fn unmount_detach(target: &Path) -> io::Result<()> {
    let t = c_path(target)?;
    // SAFETY: a valid NUL-terminated C string that outlives the call.
    check(unsafe { libc::umount2(t.as_ptr(), libc::MNT_DETACH) })
}
