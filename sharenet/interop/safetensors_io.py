"""safetensors files read and written tensor by tensor, without torch.

The format (huggingface/safetensors, "format" in its README): an 8-byte little-endian header
length N, N bytes of JSON {name: {dtype, shape, data_offsets: [begin, end]}, "__metadata__":
{...}}, then the raw little-endian buffers, offsets relative to the end of the header. Reading
one tensor is one seek and one read, so a conversion holds one source tensor at a time; writing
takes the header first (names, dtypes, shapes) and then streams each tensor's bytes.
bfloat16 has no numpy dtype: its 16 bits are the top half of a float32, widened exactly.
"""
from __future__ import annotations

import json
import os
import struct
from typing import Callable, Iterable, Iterator

import numpy as np

from sharenet.errors import ConfigError

# safetensors dtype -> numpy dtype held after reading (BF16 widened to float32, exactly).
READABLE = {'F64': np.float64, 'F32': np.float32, 'F16': np.float16, 'BF16': np.float32,
            'I64': np.int64, 'I32': np.int32}
_WRITTEN = {np.dtype(np.float32): 'F32', np.dtype(np.float64): 'F64',
            np.dtype(np.float16): 'F16'}


class SafetensorsFile:
  """One .safetensors file: its header read once, each tensor read on demand."""

  def __init__(self, path: str):
    self.path = path
    try:
      with open(path, 'rb') as f:
        (n,) = struct.unpack('<Q', f.read(8))
        header = json.loads(f.read(n))
    except (OSError, struct.error, ValueError) as e:
      raise ConfigError(f'{path} is not a readable safetensors file ({e})') from None
    self.metadata = header.pop('__metadata__', None) or {}
    self.entries = header
    self.data_start = 8 + n

  def names(self) -> list[str]:
    return list(self.entries)

  def shape(self, name: str) -> tuple[int, ...]:
    return tuple(self.entries[name]['shape'])

  def check_dtype(self, name: str) -> None:
    """ConfigError unless tensor `name`'s dtype is one sharenet reads (READABLE)."""
    dt = self.entries[name]['dtype']
    if dt not in READABLE:
      raise ConfigError(f'{self.path}: tensor {name} has dtype {dt}, which sharenet cannot '
                        f'hold; valid: {", ".join(READABLE)}')

  def read(self, name: str) -> np.ndarray:
    """Tensor `name` as a numpy array (BF16 as float32); a dtype not in READABLE is an error."""
    self.check_dtype(name)
    e = self.entries[name]
    dt = e['dtype']
    begin, end = e['data_offsets']
    with open(self.path, 'rb') as f:
      f.seek(self.data_start + begin)
      buf = f.read(end - begin)
    if dt == 'BF16':
      bits = np.frombuffer(buf, '<u2').astype(np.uint32) << 16
      return bits.view(np.float32).reshape(e['shape'])
    return np.frombuffer(buf, np.dtype(READABLE[dt]).newbyteorder('<')).reshape(
        e['shape']).astype(READABLE[dt])


def open_model(model_dir: str) -> dict[str, SafetensorsFile]:
  """{tensor name: the file holding it} of a Hugging Face directory: model.safetensors, or
  the shards model.safetensors.index.json names, or every *.safetensors file."""
  index = os.path.join(model_dir, 'model.safetensors.index.json')
  if os.path.isfile(index):
    with open(index) as f:
      weight_map = json.load(f)['weight_map']
    files = sorted(set(weight_map.values()))
  else:
    files = sorted(n for n in os.listdir(model_dir) if n.endswith('.safetensors'))
  if not files:
    raise ConfigError(f'--model {model_dir} holds no *.safetensors file; valid: a Hugging Face '
                      f'model directory saved with safe_serialization (pytorch_model.bin is '
                      f'not read)')
  out: dict[str, SafetensorsFile] = {}
  for name in files:
    path = os.path.join(model_dir, name)
    if not os.path.isfile(path):
      raise ConfigError(f'--model {model_dir}: the shard index names {name}, which is missing')
    st = SafetensorsFile(path)
    out.update({t: st for t in st.names()})
  return out


def write(path: str, tensors: Iterable[tuple[str, tuple[int, ...], np.dtype]],
          produce: Callable[[str], np.ndarray], metadata: dict[str, str] | None = None) -> None:
  """Writes a safetensors file whose tensors (name, shape, dtype) are listed first and whose
  bytes `produce(name)` returns one at a time, so only one tensor is held while writing."""
  entries, offset = {}, 0
  specs = list(tensors)
  for name, shape, dtype in specs:
    dtype = np.dtype(dtype)
    if dtype not in _WRITTEN:
      raise ConfigError(f'tensor {name}: dtype {dtype} is not written; valid: float16, '
                        f'float32, float64')
    size = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    entries[name] = {'dtype': _WRITTEN[dtype], 'shape': list(shape),
                     'data_offsets': [offset, offset + size]}
    offset += size
  header = {'__metadata__': metadata or {'format': 'pt'}, **entries}
  raw = json.dumps(header, separators=(',', ':')).encode()
  raw += b' ' * (-len(raw) % 8)   # buffers start 8-aligned, as the reference writer pads
  with open(path, 'wb') as f:
    f.write(struct.pack('<Q', len(raw)))
    f.write(raw)
    for name, shape, dtype in specs:
      a = np.ascontiguousarray(produce(name), dtype=np.dtype(dtype).newbyteorder('<'))
      if a.shape != tuple(shape):
        raise AssertionError(f'{name}: produced {a.shape}, declared {tuple(shape)}')
      f.write(a.data)   # the buffer itself, no bytes copy


def tensors(files: dict[str, SafetensorsFile]) -> Iterator[str]:
  """Tensor names in file order (one file's reads stay together)."""
  return iter(sorted(files, key=lambda n: (files[n].path, files[n].entries[n]['data_offsets'])))
