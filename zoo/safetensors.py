"""The safetensors format, read lazily and written whole, with numpy.

A file is an 8-byte little-endian header length N, N bytes of JSON ({name: {dtype, shape,
data_offsets: [begin, end]}, "__metadata__": {str: str}}), then the tensors' bytes, offsets relative
to the end of the header. `SafetensorsFile` checks the header against the file's size when it
opens it, then maps each tensor read from disk on demand (np.memmap), so a checkpoint larger than
memory is read one tensor at a time. Written here rather than taken from the `safetensors` package:
the reader is these few lines over np.memmap, and its errors can name the file and the tensor.
"""

import json
import math
from pathlib import Path

import ml_dtypes
import numpy as np

DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
          "F8_E4M3": ml_dtypes.float8_e4m3fn, "F8_E5M2": ml_dtypes.float8_e5m2,  # FP8 checkpoints (DeepSeek-V3's)
          "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8, "BOOL": np.bool_}
NAMES = {np.dtype(v): k for k, v in DTYPES.items()}


class SafetensorsFile:
    def __init__(self, path):
        self.path = Path(path)
        size = self.path.stat().st_size
        with open(self.path, "rb") as f:
            head = f.read(8)
            n = int.from_bytes(head, "little") if len(head) == 8 else -1
            if not 0 < n <= size - 8:
                raise ValueError(f"{self.path}: not a safetensors file, or truncated: its header length "
                                 f"{n} does not fit the file's {size} bytes")
            try:
                header = json.loads(f.read(n))
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                raise ValueError(f"{self.path}: unreadable safetensors header ({e})") from None
        self.metadata = header.pop("__metadata__", None) or {}
        self.data_start, self.entries = 8 + n, header
        for name, e in header.items():
            if e.get("dtype") not in DTYPES:
                raise ValueError(f"{self.path}: tensor {name} has dtype {e.get('dtype')!r}; expected one of "
                                 f"{', '.join(DTYPES)}")
            begin, end = e["data_offsets"]
            expected = math.prod(e["shape"]) * np.dtype(DTYPES[e["dtype"]]).itemsize
            if end - begin != expected or self.data_start + end > size:
                raise ValueError(f"{self.path}: tensor {name} ({e['dtype']} {e['shape']}) needs bytes {begin}..{end} "
                                 f"of the data, {expected} bytes, but the file holds {size - self.data_start} "
                                 "bytes of data (truncated or corrupt)")

    def keys(self):
        return self.entries.keys()

    def shape(self, name: str) -> tuple:
        return tuple(self.entries[name]["shape"])

    def dtype(self, name: str) -> str:
        """The tensor's dtype as the header names it ("F32", "F8_E4M3", ...)."""
        return self.entries[name]["dtype"]

    def get(self, name: str) -> np.ndarray:
        e = self.entries[name]
        dtype, shape = np.dtype(DTYPES[e["dtype"]]), tuple(e["shape"])
        if not math.prod(shape):
            return np.zeros(shape, dtype)
        return np.memmap(self.path, dtype, "r", self.data_start + e["data_offsets"][0], shape)


def write(path, tensors: dict[str, np.ndarray], metadata: dict[str, str] | None = None):
    """One file holding `tensors` (name -> array), names sorted, the header padded to 8 bytes."""
    header, offset = {}, 0
    arrays = {k: np.ascontiguousarray(tensors[k]) for k in sorted(tensors)}
    for name, a in arrays.items():
        if a.dtype not in NAMES:
            raise ValueError(f"safetensors: tensor {name} has dtype {a.dtype}, which the format lacks")
        header[name] = {"dtype": NAMES[a.dtype], "shape": list(a.shape), "data_offsets": [offset, offset + a.nbytes]}
        offset += a.nbytes
    if metadata:
        header["__metadata__"] = metadata
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    with open(path, "wb") as f:
        f.write(len(blob).to_bytes(8, "little"))
        f.write(blob)
        for a in arrays.values():
            f.write(a.tobytes())
