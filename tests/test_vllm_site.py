"""The vLLM site packer's local steps (``scripts/vllm_site.py``); downloading and the GPU check are not
run here."""

from scripts.vllm_site import DROP, drop_unused, split


def test_drop_unused_removes_what_an_h100_run_never_loads(tmp_path):
    files = {
        "vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so": 300,  # dropped
        "vllm/vllm_flash_attn/_vllm_fa3_C.abi3.so": 200,
        "vllm/third_party/fmha_sm100/cutlass/x.hpp": 50,  # dropped (folder)
        "vllm/third_party/deep_gemm/_C.cpython-311-x86_64-linux-gnu.so": 40,  # dropped: another Python
        "vllm/third_party/deep_gemm/_C.cpython-312-x86_64-linux-gnu.so": 40,
        "vllm/third_party/deep_gemm/_C.cpython-314-x86_64-linux-gnu.so": 40,  # dropped
        "vllm/__pycache__/a.cpython-312.pyc": 10,  # dropped
        "vllm/__init__.py": 5,
    }
    for name, size in files.items():
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"x" * size)
    assert drop_unused(tmp_path, DROP) == 300 + 50 + 40 + 40 + 10
    left = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*") if p.is_file())
    assert left == ["vllm/__init__.py", "vllm/third_party/deep_gemm/_C.cpython-312-x86_64-linux-gnu.so",
                    "vllm/vllm_flash_attn/_vllm_fa3_C.abi3.so"]


def test_split_parts_join_back(tmp_path):
    data = bytes(range(256)) * (3 * 2**12 + 7)  # 3 MiB + 1792 bytes
    archive = tmp_path / "site.tar.xz"
    archive.write_bytes(data)
    parts = split(archive, 1)
    assert [p.name for p in parts] == ["part00", "part01", "part02", "part03"]
    assert all(p.stat().st_size == 2**20 for p in parts[:-1]) and not archive.exists()
    assert b"".join(p.read_bytes() for p in parts) == data
