"""Extract Jane Austen's six novels from Debian's ``r-cran-janeaustenr`` package as plain text.

The package (MIT; the novels themselves are in the public domain) keeps the texts as R lazy-load
data: ``data/Rdata.rdx`` is a gzip'd R serialization of the index (object name -> offset, length
in ``Rdata.rdb``); each ``Rdata.rdb`` entry is a 4-byte big-endian length, a compression byte
and a zlib/bzip2/xz stream of an XDR R serialization. The novels are character vectors of lines.
This reads that format directly, so no R is needed::

    apt-get download r-cran-janeaustenr && dpkg-deb -x r-cran-janeaustenr_*.deb /tmp/ja
    python tools/extract_corpus.py --package /tmp/ja --out /tmp/austen   # or --deb the .deb
"""
from __future__ import annotations

import argparse
import bz2
import gzip
import lzma
import struct
import subprocess
import sys
import tempfile
import zlib
from pathlib import Path

NOVELS = ("sensesensibility", "prideprejudice", "mansfieldpark", "emma", "northangerabbey", "persuasion")
DATA_DIR = "usr/lib/R/site-library/janeaustenr/data"
_NIL, _REF, _SPECIALS = 254, 255, {242, 241, 251, 253}  # NILVALUE, REFSXP; empty/base env, missing, global


class RReader:
    """The subset of R's XDR serialization (format 2 and 3) the janeaustenr data uses."""

    def __init__(self, data: bytes) -> None:
        if data[:2] != b"X\n":
            raise ValueError("not an XDR R serialization")
        self.data, self.pos, self.refs = data, 2, []
        version = self.int()
        self.int(), self.int()  # writer and minimal reader R versions
        if version == 3:
            self.bytes(self.int())  # native encoding

    def int(self) -> int:
        (v,) = struct.unpack_from(">i", self.data, self.pos)
        self.pos += 4
        return v

    def bytes(self, n: int) -> bytes:
        b = self.data[self.pos:self.pos + n]
        self.pos += n
        return b

    def item(self):
        flags = self.int()
        kind, has_attr, has_tag = flags & 0xFF, flags & (1 << 9), flags & (1 << 10)
        if kind == _NIL or kind in _SPECIALS:
            return None
        if kind == _REF:
            index = flags >> 8 or self.int()
            return self.refs[index - 1]
        if kind == 1:  # SYMSXP
            sym = self.item()
            self.refs.append(sym)
            return sym
        if kind in (2, 4):  # LISTSXP (pairlist), ENVSXP is not expected
            if kind == 4:
                raise ValueError("environments are not supported")
            if has_attr:
                self.item()
            tag = self.item() if has_tag else None
            head = [(tag, self.item())]
            rest = self.item()
            return head + (rest if isinstance(rest, list) else [])
        if kind == 9:  # CHARSXP
            n = self.int()
            return None if n == -1 else self.bytes(n).decode("utf-8", "replace")
        if kind in (10, 13, 14, 16, 19):
            n = self.int()
            if kind == 16 or kind == 19:  # STRSXP, VECSXP
                value = [self.item() for _ in range(n)]
            elif kind == 14:
                value = list(struct.unpack_from(f">{n}d", self.data, self.pos))
                self.pos += 8 * n
            else:
                value = list(struct.unpack_from(f">{n}i", self.data, self.pos))
                self.pos += 4 * n
            if has_attr:
                attrs = dict(self.item())
                if "names" in attrs and kind == 19:
                    return dict(zip(attrs["names"], value))
            return value
        raise ValueError(f"R type {kind} is not supported")


def _unpack_entry(raw: bytes) -> bytes:
    kind = raw[4:5]
    if kind == b"2":
        return bz2.decompress(raw[5:])
    if kind == b"X":
        return lzma.decompress(raw[5:])
    if kind == b"0":
        return raw[5:]
    return zlib.decompress(raw[4:])


def read_lazy_data(data_dir: Path) -> dict[str, list]:
    """Every object of an R package's ``data/Rdata.rdb`` by name."""
    index = RReader(gzip.decompress((data_dir / "Rdata.rdx").read_bytes())).item()
    if not isinstance(index, dict) or not isinstance(index.get("variables"), dict):
        raise ValueError("unexpected Rdata.rdx layout")
    db = (data_dir / "Rdata.rdb").read_bytes()
    out = {}
    for name, (offset, length) in index["variables"].items():
        out[name] = RReader(_unpack_entry(db[int(offset):int(offset) + int(length)])).item()
    return out


def novels_text(package_root: Path) -> dict[str, str]:
    """The six novels as text, one string each (lines joined with newlines)."""
    objects = read_lazy_data(package_root / DATA_DIR)
    missing = [n for n in NOVELS if n not in objects]
    if missing:
        raise ValueError(f"janeaustenr data lacks {missing}; found {sorted(objects)}")
    return {n: "\n".join(line or "" for line in objects[n]) + "\n" for n in NOVELS}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--package", type=Path, help="root of the unpacked .deb (dpkg-deb -x)")
    src.add_argument("--deb", type=Path, help="r-cran-janeaustenr_*.deb (from apt-get download)")
    p.add_argument("--out", type=Path, required=True, help="folder for <novel>.txt")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        root = args.package
        if args.deb:
            subprocess.run(["dpkg-deb", "-x", str(args.deb), tmp], check=True)
            root = Path(tmp)
        texts = novels_text(root)
    args.out.mkdir(parents=True, exist_ok=True)
    for name, text in texts.items():
        (args.out / f"{name}.txt").write_text(text)
        print(f"{name}: {len(text):,} characters", file=sys.stderr)


if __name__ == "__main__":
    main()
