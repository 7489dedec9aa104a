"""A directory's tensors in the Hugging Face safetensors layout, read and written as NumPy arrays.

This module owns the file layout, not what the tensors mean:

* one file, ``model.safetensors``; or
* shards ``model-00001-of-0000N.safetensors`` ... listed by ``model.safetensors.index.json``
  (``{"metadata": {"total_size": bytes, ...}, "weight_map": {tensor name: shard file}}``).

Arrays are NumPy arrays; bfloat16 tensors come back as ``ml_dtypes.bfloat16`` arrays (the type
``jax.numpy.bfloat16`` is) and are written from them. Written files carry the metadata
``{"format": "pt"}``, which transformers requires of a checkpoint it loads.

`LazyTensors` reads a directory's tensors on demand and in parts (loading into shards).

Errors name the file: a missing directory or file, an index that is not JSON or places a tensor
in a shard that lacks it, a file that cannot be read.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping

import numpy as np

SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"
FILE_METADATA = {"format": "pt"}


def _open_error(path: str, error: Exception) -> ValueError:
  return ValueError(f"{path}: not a readable safetensors file ({type(error).__name__}: {error})")


def _read_file(path: str, names: set[str] | None = None) -> dict[str, np.ndarray]:
  """The tensors of one safetensors file (only `names` if given) as NumPy arrays."""
  from safetensors import safe_open

  if not os.path.isfile(path):
    raise FileNotFoundError(f"{path}: no such safetensors file")
  try:
    handle = safe_open(path, framework="np")
  except Exception as error:  # safetensors raises its own error type for a damaged header
    raise _open_error(path, error) from error
  with handle as f:
    keys = list(f.keys())
    if names is not None:
      missing = sorted(names - set(keys))
      if missing:
        raise ValueError(f"{path}: the index places tensor {missing[0]!r} in this file, but the "
                         "file does not hold it")
      keys = [k for k in keys if k in names]
    try:
      return {k: f.get_tensor(k) for k in keys}
    except Exception as error:  # a truncated file fails here, after its header parsed
      raise _open_error(path, error) from error


def read_index(directory: str) -> dict[str, str] | None:
  """The ``weight_map`` (tensor name -> shard file name) of a sharded directory, or None when the
  directory has no index file. ValueError names the index if it is not valid."""
  path = os.path.join(directory, INDEX)
  if not os.path.isfile(path):
    return None
  try:
    with open(path) as f:
      index = json.load(f)
  except (OSError, json.JSONDecodeError) as error:
    raise ValueError(f"{path}: not a JSON index ({error})") from None
  weight_map = index.get("weight_map") if isinstance(index, dict) else None
  if not isinstance(weight_map, dict) or not all(
      isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()):
    raise ValueError(f"{path}: expected an object with a 'weight_map' of tensor name -> file name")
  bad = [v for v in weight_map.values() if os.path.basename(v) != v]
  if bad:
    raise ValueError(f"{path}: shard file {bad[0]!r} is not a file name in this directory")
  return weight_map


def read_tensors(directory: str) -> dict[str, np.ndarray]:
  """All tensors of a checkpoint directory: ``model.safetensors.index.json`` and its shards if the
  index exists, else ``model.safetensors``.

  Raises:
    FileNotFoundError: no such directory, or neither file exists (naming what was looked for), or
      a shard the index names is absent.
    ValueError: an unreadable index or file, or a tensor the index places in a file that lacks it
      (naming the file).
  """
  directory = os.fspath(directory)
  if not os.path.isdir(directory):
    raise FileNotFoundError(f"{directory}: no such checkpoint directory")
  weight_map = read_index(directory)
  if weight_map is None:
    path = os.path.join(directory, SINGLE)
    if not os.path.isfile(path):
      raise FileNotFoundError(f"{directory}: holds neither {SINGLE} nor {INDEX}")
    return _read_file(path)
  by_file: dict[str, set[str]] = {}
  for name, file in weight_map.items():
    by_file.setdefault(file, set()).add(name)
  tensors = {}
  for file in sorted(by_file):
    tensors.update(_read_file(os.path.join(directory, file), by_file[file]))
  return tensors


def tensor_dtypes(directory: str) -> dict[str, str]:
  """``{tensor name: safetensors dtype ("BF16", "F32", ...)}`` read from the headers only."""
  from safetensors import safe_open

  weight_map = read_index(directory)
  files = sorted(set(weight_map.values())) if weight_map is not None else [SINGLE]
  out = {}
  for file in files:
    path = os.path.join(directory, file)
    try:
      with safe_open(path, framework="np") as f:
        out.update({k: f.get_slice(k).get_dtype() for k in f.keys()})
    except FileNotFoundError:
      raise FileNotFoundError(f"{path}: no such safetensors file") from None
    except Exception as error:
      raise _open_error(path, error) from error
  return out


def _shards(names: list[str], sizes: Mapping[str, int], max_bytes: int) -> list[list[str]]:
  """Tensors split in order into runs of at most `max_bytes` (a larger tensor gets its own run)."""
  shards, current, used = [], [], 0
  for name in names:
    if current and used + sizes[name] > max_bytes:
      shards.append(current)
      current, used = [], 0
    current.append(name)
    used += sizes[name]
  if current:
    shards.append(current)
  return shards


def write_tensors(directory: str, tensors: Mapping[str, np.ndarray], *,
                  max_shard_bytes: int | None = None) -> list[str]:
  """Writes `tensors` into `directory` (created if needed) in the Hugging Face layout.

  Args:
    directory: the output directory. Files of a previous checkpoint there (``model.safetensors``,
      the index and ``model-*-of-*.safetensors``) are removed first, so the directory holds one
      consistent checkpoint.
    tensors: tensor name -> array (NumPy, JAX or anything ``np.asarray`` takes; bfloat16 kept).
    max_shard_bytes: None writes one ``model.safetensors``; an int >= 1 splits the tensors, in
      name order, into shards of at most that many bytes (a larger tensor gets a shard of its own)
      and writes the index, even when one shard results.

  Returns:
    The names of the files written.
  """
  from safetensors.numpy import save_file

  if max_shard_bytes is not None and (isinstance(max_shard_bytes, bool) or not isinstance(
      max_shard_bytes, (int, np.integer)) or max_shard_bytes < 1):
    raise ValueError(f"max_shard_bytes: expected None or an integer >= 1, got {max_shard_bytes!r}")
  arrays = {name: np.ascontiguousarray(np.asarray(value)) for name, value in tensors.items()}
  os.makedirs(directory, exist_ok=True)
  for file in os.listdir(directory):
    if file in (SINGLE, INDEX) or (file.startswith("model-") and file.endswith(".safetensors")
                                   and "-of-" in file):
      os.remove(os.path.join(directory, file))
  if max_shard_bytes is None:
    save_file(arrays, os.path.join(directory, SINGLE), metadata=dict(FILE_METADATA))
    return [SINGLE]
  names = sorted(arrays)
  shards = _shards(names, {k: v.nbytes for k, v in arrays.items()}, int(max_shard_bytes))
  files, weight_map = [], {}
  for i, shard in enumerate(shards):
    file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
    save_file({k: arrays[k] for k in shard}, os.path.join(directory, file),
              metadata=dict(FILE_METADATA))
    weight_map.update({k: file for k in shard})
    files.append(file)
  index = {"metadata": {"total_size": int(sum(v.nbytes for v in arrays.values())),
                        "total_parameters": int(sum(v.size for v in arrays.values()))},
           "weight_map": weight_map}
  with open(os.path.join(directory, INDEX), "w") as f:
    json.dump(index, f, indent=2, sort_keys=True)
    f.write("\n")
  return files + [INDEX]


_DTYPES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16",
           "I64": "int64", "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8",
           "BOOL": "bool"}


class Header:
  """A tensor's shape and dtype as a file's header gives them (``.T``: the transposed header)."""

  def __init__(self, shape: tuple[int, ...], dtype):
    self.shape, self.dtype = tuple(shape), np.dtype(dtype)

  @property
  def T(self) -> "Header":
    return Header(self.shape[::-1], self.dtype)


class LazyTensors(Mapping):
  """A checkpoint directory's tensors, read on demand and in parts (a tensor name -> `Header`
  mapping, plus `read`), for loading straight into shards without a whole copy on the host.

  Attributes:
    bytes_read: bytes returned by `read` so far. largest_read: ``{name: the most bytes one
      read of it returned}``.
  """

  def __init__(self, directory: str):
    import ml_dtypes  # noqa: F401  (registers bfloat16 with NumPy)
    from safetensors import safe_open

    directory = os.fspath(directory)
    if not os.path.isdir(directory):
      raise FileNotFoundError(f"{directory}: no such checkpoint directory")
    weight_map = read_index(directory)
    if weight_map is None:
      if not os.path.isfile(os.path.join(directory, SINGLE)):
        raise FileNotFoundError(f"{directory}: holds neither {SINGLE} nor {INDEX}")
      files = [SINGLE]
    else:
      files = sorted(set(weight_map.values()))
    self._files, self._headers = {}, {}
    for file in files:
      path = os.path.join(directory, file)
      if not os.path.isfile(path):
        raise FileNotFoundError(f"{path}: no such safetensors file")
      try:
        with safe_open(path, framework="np") as f:
          for name in f.keys():
            if weight_map is not None and weight_map.get(name) != file:
              continue
            part = f.get_slice(name)
            dtype = _DTYPES.get(part.get_dtype())
            if dtype is None:
              raise ValueError(f"{path}: tensor {name!r} has dtype {part.get_dtype()}, which is not "
                               "read here")
            self._headers[name] = Header(part.get_shape(), jnp_dtype(dtype))
            self._files[name] = path
      except (FileNotFoundError, ValueError):
        raise
      except Exception as error:
        raise _open_error(path, error) from error
    missing = sorted(set(weight_map or ()) - set(self._headers))
    if missing:
      raise ValueError(f"{directory}: the index places tensor {missing[0]!r} in "
                       f"{weight_map[missing[0]]}, but the file does not hold it")
    self.bytes_read = 0
    self.largest_read: dict[str, int] = {}

  def __getitem__(self, name: str) -> Header:
    return self._headers[name]

  def __iter__(self):
    return iter(self._headers)

  def __len__(self) -> int:
    return len(self._headers)

  def read(self, name: str, index: tuple[slice, ...]) -> np.ndarray:
    """The part `index` (one slice per axis) of tensor `name`, as a NumPy array."""
    from safetensors import safe_open

    with safe_open(self._files[name], framework="np") as f:
      value = np.asarray(f.get_slice(name)[tuple(index)])
    self.bytes_read += value.nbytes
    self.largest_read[name] = max(self.largest_read.get(name, 0), value.nbytes)
    return value


def jnp_dtype(name: str) -> np.dtype:
  """A NumPy dtype by name, bfloat16 included (as ``ml_dtypes.bfloat16``)."""
  import ml_dtypes

  return np.dtype(ml_dtypes.bfloat16) if name == "bfloat16" else np.dtype(name)
