"""Rebuild polspec/data/polish-words.tsv.gz from the wordfreq package's Polish word list.

    pip download wordfreq==3.1.1 msgpack --no-deps -d /tmp/wordfreq
    python scripts/polish-words-from-wordfreq.py /tmp/wordfreq/wordfreq-3.1.1-py3-none-any.whl

Not run by setup or tests: the output is committed. It keeps the WORDS most frequent words of
wordfreq's ``large_pl`` list, one ``word<TAB>centibels`` line each (frequency = 10^(-cB/100)),
in wordfreq's order: most frequent first, ties in its own order, so the file is reproducible.
"""

import gzip
import io
import sys
import zipfile
from pathlib import Path

import msgpack

WORDS = 50_000
OUTPUT = Path(__file__).resolve().parent.parent / "polspec" / "data" / "polish-words.tsv.gz"


def main(wheel: str) -> None:
    with zipfile.ZipFile(wheel) as archive:
        packed = archive.read("wordfreq/data/large_pl.msgpack.gz")
    header, *buckets = msgpack.unpackb(gzip.decompress(packed), raw=False)
    if header != {"format": "cB", "version": 1}:
        sys.exit(f"unexpected wordfreq data format {header}")
    lines = []
    for centibels, words in enumerate(buckets):
        lines += [f"{word}\t{centibels}" for word in words]
        if len(lines) >= WORDS:
            break
    text = "\n".join(lines[:WORDS]) + "\n"
    buffer = io.BytesIO()
    with gzip.GzipFile(fileobj=buffer, mode="wb", mtime=0) as handle:
        handle.write(text.encode("utf-8"))
    OUTPUT.write_bytes(buffer.getvalue())
    print(f"{OUTPUT}: {WORDS} words, {len(buffer.getvalue())} bytes")


if __name__ == "__main__":
    main(sys.argv[1])
