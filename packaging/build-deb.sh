#!/usr/bin/env bash
# Builds ${CARGO_TARGET_DIR:-target}/debian/claimd_<version>_amd64.deb with Debian's own tools
# (dpkg-deb): the static binary in /usr/bin, the unit in the systemd system
# directory, the config as a conffile under /etc/claimd, the manual and
# example configs under /usr/share/doc/claimd, the man page, maintainer
# scripts.
# Prints the package's path on the last line.
#
#   packaging/build-deb.sh                    # builds the static binary first
#   CLAIMD_BIN=path VERSION=0.1.1 packaging/build-deb.sh   # a given binary/version
set -euo pipefail
cd "$(dirname "$0")/.."

version=${VERSION:-$(sed -n 's/^version = "\(.*\)"/\1/p' Cargo.toml | head -1)}
arch=amd64
bin=${CLAIMD_BIN:-$(packaging/build-static.sh | tail -1)}

out=${CARGO_TARGET_DIR:-target}/debian
root="$out/claimd_${version}_${arch}"
rm -rf "$root"
install -d -m 0755 "$root/DEBIAN" "$root/usr/bin" "$root/lib/systemd/system" \
  "$root/etc/claimd" "$root/usr/share/doc/claimd/examples" "$root/usr/share/man/man8" \
  "$root/usr/share/lintian/overrides"
install -m 0755 "$bin" "$root/usr/bin/claimd"
install -m 0644 packaging/claimd.service "$root/lib/systemd/system/claimd.service"
install -m 0644 packaging/config.json "$root/etc/claimd/config.json"
install -m 0644 packaging/debian/copyright "$root/usr/share/doc/claimd/copyright"
# The manual (packaging/doc/*.md, flat: its pages link to each other by
# name), the upstream changelog and the example configs.
install -m 0644 packaging/doc/*.md packaging/CHANGELOG.md "$root/usr/share/doc/claimd/"
install -m 0644 packaging/examples/*.json "$root/usr/share/doc/claimd/examples/"
install -m 0644 packaging/debian/lintian-overrides "$root/usr/share/lintian/overrides/claimd"
sed "s/@VERSION@/$version/" packaging/debian/changelog | gzip -9n >"$root/usr/share/doc/claimd/changelog.gz"
gzip -9n <packaging/claimd.8 >"$root/usr/share/man/man8/claimd.8.gz"
chmod 0644 "$root/usr/share/doc/claimd/changelog.gz" "$root/usr/share/man/man8/claimd.8.gz"

size=$(du -sk --exclude=DEBIAN "$root" | cut -f1)
sed -e "s/@VERSION@/$version/" -e "s/@ARCH@/$arch/" -e "s/@SIZE@/$size/" \
  packaging/debian/control.in >"$root/DEBIAN/control"
echo /etc/claimd/config.json >"$root/DEBIAN/conffiles"
for s in postinst prerm postrm; do
  install -m 0755 "packaging/debian/$s" "$root/DEBIAN/$s"
done
(cd "$root" && find . -path ./DEBIAN -prune -o -type f -printf '%P\n' | sort | xargs md5sum) >"$root/DEBIAN/md5sums"
chmod 0644 "$root/DEBIAN/control" "$root/DEBIAN/conffiles" "$root/DEBIAN/md5sums"

deb="$out/claimd_${version}_${arch}.deb"
dpkg-deb --root-owner-group -Zxz --build "$root" "$deb" >&2
echo "$deb"
