#!/bin/sh
# Mooncake's transfer engine (the `pd` extra) links against libibverbs even when it only uses
# its TCP transport, and its wheel does not carry it. Where the system lacks it, take Debian's
# libibverbs1 and the two libnl libraries it needs into DEST (no root: `apt-get download` +
# `dpkg -x`); kdaserve/disaggregation/mooncake.py preloads them from there.
set -e
DEST=$1
if ldconfig -p 2>/dev/null | grep -q 'libibverbs.so.1 '; then exit 0; fi
if [ -e "$DEST/libibverbs.so.1" ]; then exit 0; fi
command -v apt-get >/dev/null || { echo "no libibverbs.so.1 and no apt-get: install rdma-core's libibverbs for disaggregation" >&2; exit 0; }
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
if ! (cd "$TMP" && apt-get download -q libibverbs1 libnl-3-200 libnl-route-3-200 >/dev/null 2>&1); then
    echo "could not download libibverbs1 from Debian: disaggregation (Mooncake) will not load" >&2
    exit 0
fi
mkdir -p "$DEST"
for deb in "$TMP"/*.deb; do dpkg -x "$deb" "$TMP/root"; done
find "$TMP/root" -name 'lib*.so.*' -exec cp -P {} "$DEST/" \;
ls "$DEST"
