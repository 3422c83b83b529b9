"""st.py - a minimal safetensors reader and writer, written from the file format itself.

Part of the kimik3 course tools (never needed to build the C++ engine). Used by the tiny-K3
generator, the PyTorch reference and the fixture writers. It depends on torch only (no
`safetensors` package), so the whole format fits on one screen:

    +----------------------+------------------------------------+---------------------------+
    | N: u64 little-endian | header: N bytes of UTF-8 JSON,     | data: raw little-endian   |
    | (8 bytes)            | padded with spaces to N % 8 == 0   | tensor bytes, contiguous  |
    +----------------------+------------------------------------+---------------------------+

    header = {"__metadata__": {str: str, ...},                      (optional)
              "NAME": {"dtype": "BF16", "shape": [r, c], "data_offsets": [begin, end]}, ...}

`data_offsets` are byte offsets relative to the start of the data section (byte 8 + N). The
official writer pads the header with spaces (0x20) so that the data section starts at a multiple
of 8 bytes; we do the same. A valid file covers the data section exactly: no holes, no overlaps.

What this file does:   the ten dtypes listed in DTYPES, `__metadata__` (str -> str), tensors in
                       the order the caller gives (the writer does NOT sort them), lazy per-tensor
                       reads (only the bytes of the requested tensor are read), atomic writes
                       (temporary file + rename), strict validation on read.
What it leaves out:    big-endian hosts (refused), memory mapping, the F8/F4 dtypes, zero-copy.

Determinism: the same tensors, order and metadata always give byte-identical files (the JSON is
written compactly, keys in the given order, and nothing depends on time or on the host).
"""

import json
import math
import os
import sys

import torch

if sys.byteorder != "little":  # safetensors data is little-endian; we copy raw bytes
    raise RuntimeError("st.py supports little-endian hosts only")

# safetensors dtype name -> (torch dtype, bytes per element).
DTYPES = {
    "BF16": (torch.bfloat16, 2),
    "F16": (torch.float16, 2),
    "F32": (torch.float32, 4),
    "F64": (torch.float64, 8),
    "U8": (torch.uint8, 1),
    "I8": (torch.int8, 1),
    "I16": (torch.int16, 2),
    "I32": (torch.int32, 4),
    "I64": (torch.int64, 8),
    "BOOL": (torch.bool, 1),
}
# torch dtype -> safetensors dtype name (the inverse map, for the writer).
TORCH_TO_ST = {torch_dtype: name for name, (torch_dtype, _) in DTYPES.items()}

MAX_HEADER_BYTES = 100 * 1000 * 1000  # the official reader's limit on N (100 MB)


# ------------------------------------------------------------------------------------------------
# 1. Reading
# ------------------------------------------------------------------------------------------------

class SafetensorsFile:
    """One safetensors file, opened for lazy per-tensor reads.

    Attributes:
      path        the file name
      metadata    dict str -> str (empty when the file has no __metadata__)
      entries     dict name -> {"dtype", "shape", "data_offsets"} in header order
      data_start  absolute file offset of the data section (8 + N)
    """

    def __init__(self, path):
        self.path = path
        with open(path, "rb") as f:
            raw_len = f.read(8)
            if len(raw_len) != 8:
                raise ValueError(f"{path}: shorter than the 8-byte header length")
            header_len = int.from_bytes(raw_len, "little")
            if header_len > MAX_HEADER_BYTES:
                raise ValueError(f"{path}: header length {header_len} is implausible")
            header_bytes = f.read(header_len)
            if len(header_bytes) != header_len:
                raise ValueError(f"{path}: truncated header")
        file_size = os.path.getsize(path)
        # The JSON may be followed by space padding; json.loads tolerates trailing whitespace.
        header = json.loads(header_bytes.decode("utf-8"))
        if not isinstance(header, dict):
            raise ValueError(f"{path}: header is not a JSON object")
        self.metadata = header.pop("__metadata__", None) or {}
        for key, value in self.metadata.items():
            if not isinstance(key, str) or not isinstance(value, str):
                raise ValueError(f"{path}: __metadata__ must map str to str")
        self.data_start = 8 + header_len
        self.entries = header
        self._validate(file_size - self.data_start)

    def _validate(self, data_size):
        """Check dtypes, byte sizes and that the tensors tile the data section exactly."""
        spans = []
        for name, entry in self.entries.items():
            dtype = entry.get("dtype")
            if dtype not in DTYPES:
                raise ValueError(f"{self.path}: tensor {name!r} has unsupported dtype {dtype!r}")
            shape = entry.get("shape")
            begin, end = entry.get("data_offsets", (None, None))
            if not isinstance(shape, list) or any(not isinstance(s, int) or s < 0 for s in shape):
                raise ValueError(f"{self.path}: tensor {name!r} has a bad shape {shape!r}")
            nbytes = math.prod(shape) * DTYPES[dtype][1]
            if end - begin != nbytes:
                raise ValueError(f"{self.path}: tensor {name!r} spans {end - begin} bytes, "
                                 f"its shape and dtype need {nbytes}")
            spans.append((begin, end, name))
        spans.sort()
        cursor = 0
        for begin, end, name in spans:
            if begin != cursor:
                raise ValueError(f"{self.path}: tensor {name!r} starts at {begin}, expected {cursor} "
                                 "(hole or overlap in the data section)")
            cursor = end
        if cursor != data_size:
            raise ValueError(f"{self.path}: tensors cover {cursor} bytes of a {data_size}-byte data section")

    def keys(self):
        """Tensor names in header order."""
        return list(self.entries.keys())

    def offset_of(self, name):
        """(absolute file offset, byte count) of one tensor's data."""
        begin, end = self.entries[name]["data_offsets"]
        return self.data_start + begin, end - begin

    def get(self, name):
        """Read one tensor (a fresh torch tensor that owns its memory)."""
        entry = self.entries[name]
        torch_dtype, _ = DTYPES[entry["dtype"]]
        offset, nbytes = self.offset_of(name)
        if nbytes == 0:
            return torch.empty(entry["shape"], dtype=torch_dtype)
        with open(self.path, "rb") as f:
            f.seek(offset)
            buf = bytearray(f.read(nbytes))
        if len(buf) != nbytes:
            raise ValueError(f"{self.path}: tensor {name!r} is truncated")
        return torch.frombuffer(buf, dtype=torch_dtype).reshape(entry["shape"])


def read(path):
    """Read a whole file: returns (dict name -> tensor in file header order, metadata dict)."""
    st_file = SafetensorsFile(path)
    return {name: st_file.get(name) for name in st_file.keys()}, dict(st_file.metadata)


# ------------------------------------------------------------------------------------------------
# 2. Writing
# ------------------------------------------------------------------------------------------------

def tensor_bytes(tensor):
    """The raw little-endian bytes of a tensor in row-major order."""
    tensor = tensor.detach().contiguous().cpu()
    if tensor.dtype == torch.bfloat16:  # numpy has no bfloat16: reinterpret the 2-byte patterns
        tensor = tensor.view(torch.int16)
    return tensor.numpy().tobytes()


def serialize(tensors, metadata=None):
    """Build the file contents.

    tensors:  a sequence of (name, tensor) pairs or a dict (its insertion order is kept);
              tensors are laid out in exactly this order, back to back.
    metadata: optional dict str -> str written as "__metadata__".
    """
    items = list(tensors.items()) if isinstance(tensors, dict) else list(tensors)
    header = {}
    if metadata:
        for key, value in metadata.items():
            if not isinstance(key, str) or not isinstance(value, str):
                raise TypeError("__metadata__ must map str to str")
        header["__metadata__"] = dict(metadata)
    chunks = []
    cursor = 0
    for name, tensor in items:
        if name == "__metadata__" or name in header:
            raise ValueError(f"duplicate or reserved tensor name {name!r}")
        if tensor.dtype not in TORCH_TO_ST:
            raise TypeError(f"tensor {name!r}: dtype {tensor.dtype} is not supported")
        data = tensor_bytes(tensor)
        header[name] = {
            "dtype": TORCH_TO_ST[tensor.dtype],
            "shape": list(tensor.shape),
            "data_offsets": [cursor, cursor + len(data)],
        }
        chunks.append(data)
        cursor += len(data)
    header_bytes = json.dumps(header, separators=(",", ":")).encode("utf-8")
    header_bytes += b" " * (-len(header_bytes) % 8)  # pad to a multiple of 8, as the official writer
    return len(header_bytes).to_bytes(8, "little") + header_bytes + b"".join(chunks)


def write(path, tensors, metadata=None):
    """Write a safetensors file atomically (temporary file in the same folder, then rename)."""
    contents = serialize(tensors, metadata)
    tmp_path = f"{path}.tmp{os.getpid()}"
    with open(tmp_path, "wb") as f:
        f.write(contents)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp_path, path)
    return len(contents)


if __name__ == "__main__":
    # `python3 tools/st.py FILE...` lists the tensors of each file (name, dtype, shape, offset).
    for file_name in sys.argv[1:]:
        st_file = SafetensorsFile(file_name)
        print(f"{file_name}: {len(st_file.entries)} tensors, data starts at byte {st_file.data_start}")
        for key, value in st_file.metadata.items():
            print(f"  __metadata__ {key} = {value}")
        for name in st_file.keys():
            entry = st_file.entries[name]
            offset, nbytes = st_file.offset_of(name)
            print(f"  {name:70s} {entry['dtype']:5s} {str(entry['shape']):18s} @{offset} +{nbytes}")
