"""What a writer of the log folder, bit rot or a cleanup job can do to a snapshot file: each a function of the file's
path (and of the marker file a planted pickle would create). Used by tests/test_snapshot_trust.py and its DDP
script (tests/ddp_scripts/ddp_tampered.py)."""

from __future__ import annotations

import pickle
import shutil
import zipfile
from pathlib import Path
from typing import Callable


class Evil:
    """Unpickling it creates ``marker``: the code a writer of the log folder could plant in a snapshot file."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple:
        return (open, (str(self.marker), "w"))


def code_carrying_pickle(path: Path, marker: Path) -> None:
    path.write_bytes(pickle.dumps(Evil(marker)))


def flipped_byte(path: Path, marker: Path) -> None:
    """One byte flipped in the middle of the first tensor's data (the zip member ``.../data/0``)."""
    with zipfile.ZipFile(path) as zf:
        info = next(i for i in zf.infolist() if i.filename.endswith("/data/0"))
    with open(path, "r+b") as fh:
        fh.seek(info.header_offset + 26)  # the local header's name and extra-field lengths
        name_len, extra_len = int.from_bytes(fh.read(2), "little"), int.from_bytes(fh.read(2), "little")
        at = info.header_offset + 30 + name_len + extra_len + info.file_size // 2
        fh.seek(at)
        byte = fh.read(1)
        fh.seek(at)
        fh.write(bytes([byte[0] ^ 0x10]))


def truncated(path: Path, marker: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def deleted(path: Path, marker: Path) -> None:
    path.unlink()


def swapped(path: Path, marker: Path) -> None:
    """Replaced by the file of the snapshot before it (another step: 5 steps older)."""
    older = path.with_name(f"snapshot-step{int(path.stem.removeprefix('snapshot-step')) - 5}.pt")
    shutil.copyfile(older, path)


FAULTS: dict[str, tuple[Callable[[Path, Path], None], str]] = {  # name: (tampering, the reason it is refused for)
    "pickle": (code_carrying_pickle, "restricted"),
    "flipped_byte": (flipped_byte, "digest"),
    "truncated": (truncated, "truncated"),
    "deleted": (deleted, "missing"),
    "swapped": (swapped, "swapped"),
}
