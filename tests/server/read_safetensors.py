"""Reads a moe-server checkpoint with the real `safetensors` package (PyPI) and checks every
tensor against the raw little-endian bytes the C++ test wrote next to it (<dir>/<name>.bin).
Exit 0: identical; 1: a mismatch (printed); 77: safetensors/numpy cannot be imported."""
import json
import os
import sys

try:
    import numpy as np
    from safetensors import safe_open
    from safetensors.numpy import load_file
except ImportError as e:  # the C++ test turns this into a skip with the reason
    print(f"cannot import safetensors/numpy: {e}")
    sys.exit(77)

path, expected_dir = sys.argv[1], sys.argv[2]
tensors = load_file(path)
with safe_open(path, framework="numpy") as f:
    metadata = f.metadata()
config = json.loads(metadata["moe.layer_config"])
manifest = json.load(open(os.path.join(expected_dir, "manifest.json")))
dtypes = {"float32": np.float32, "int64": np.int64, "int32": np.int32}
if sorted(tensors) != sorted(manifest):
    print(f"names differ: file {sorted(tensors)} expected {sorted(manifest)}")
    sys.exit(1)
for name, (dtype, shape) in manifest.items():
    want = np.frombuffer(open(os.path.join(expected_dir, name + ".bin"), "rb").read(),
                         dtype=np.dtype(dtypes[dtype]).newbyteorder("<")).reshape(shape)
    got = tensors[name]
    if got.dtype != want.dtype or list(got.shape) != list(shape) or not np.array_equal(
            got.view(np.uint8), want.view(np.uint8)):
        print(f"{name}: file {got.dtype}{list(got.shape)} != expected {want.dtype}{list(shape)}")
        sys.exit(1)
print(f"ok: {len(tensors)} tensors, num_experts={config['numExperts']}, step={metadata['moe.step']}")
