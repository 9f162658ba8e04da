"""The afd_ext op registry: exact schemas, one fake per op, kernels per key, build facts."""

from __future__ import annotations

import re

import pytest
import torch

ops = pytest.importorskip("afd_ext.ops", reason="afd_ext._C is not built")

SCHEMAS = {
    "nccl_version": "afd_ext::nccl_version() -> int",
    "nccl_unique_id": "afd_ext::nccl_unique_id(Tensor(a!) out) -> ()",
    "comm_create": "afd_ext::comm_create(Tensor unique_id, int world_size, int rank, int device) -> int",
    "comm_destroy": "afd_ext::comm_destroy(int handle) -> ()",
    "comm_abort": "afd_ext::comm_abort(int handle) -> ()",
    "comm_async_error": "afd_ext::comm_async_error(int handle) -> int",
    "send": "afd_ext::send(Tensor(a!) t, int comm, int peer) -> ()",
    "recv": "afd_ext::recv(Tensor(a!) t, int comm, int peer) -> ()",
    # The data ops take the wire parts as one mutable list, in wire order (afd_ext/wire.py), as torch's _foreach_*_.
    "fan_in": "afd_ext::fan_in(Tensor(a!)[] tensors, int[] comms, int[] peers, int[] rows) -> ()",
    "split_back": "afd_ext::split_back(Tensor(a!)[] tensors, int[] comms, int[] peers, int[] rows) -> ()",
    "fp8_quantize": "afd_ext::fp8_quantize(Tensor x, Tensor(a!) values, Tensor(b!) scales, bool ue8m0=False) -> ()",
    "fp8_dequantize": "afd_ext::fp8_dequantize(Tensor values, Tensor scales, Tensor(a!) out) -> ()",
    "peer_plane_create": "afd_ext::peer_plane_create(int device, int generation, int num_slots, int max_peers) -> int",
    "peer_plane_destroy": "afd_ext::peer_plane_destroy(int plane) -> ()",
    "peer_plane_error": "afd_ext::peer_plane_error(int plane) -> int[]",
    "peer_plane_abort": "afd_ext::peer_plane_abort(int plane, int op) -> ()",
    "peer_region_alloc": "afd_ext::peer_region_alloc(int plane, int nbytes) -> int",
    "peer_region_export": "afd_ext::peer_region_export(int region, Tensor(a!) out) -> ()",
    "peer_region_open": "afd_ext::peer_region_open(int plane, Tensor ipc_handle, int nbytes) -> int",
    "peer_region_close": "afd_ext::peer_region_close(int region) -> ()",
    "peer_region_view": "afd_ext::peer_region_view(int region, int offset, int nbytes) -> Tensor",
    "peer_put": (
        "afd_ext::peer_put(Tensor(a!)[] tensors, int plane, int slot, int[] regions, int[] rows, int[] dst_rows, "
        "int[] part_offsets, int[] flag_offsets, bool quantize_first=False, bool ue8m0=False) -> ()"
    ),
    "peer_wait": (
        "afd_ext::peer_wait(Tensor(a!)[] tensors, Tensor(b!)? out, int plane, int slot, int region, "
        "int[] flag_offsets, int[] peers, int op, int layer, int stage, int timeout_ns, bool dequantize=False) -> ()"
    ),
}
COMM_OPS = ("send", "recv", "fan_in", "split_back", "peer_put", "peer_wait")
TENSOR_OPS = COMM_OPS
PEER_MANAGEMENT_OPS = ("peer_plane_create", "peer_plane_destroy", "peer_plane_error", "peer_plane_abort",
                       "peer_region_alloc", "peer_region_export", "peer_region_open", "peer_region_close",
                       "peer_region_view")


def _registered() -> set[str]:
    return {n.split("::", 1)[1].split(".")[0] for n in torch._C._dispatch_get_all_op_names() if n.startswith("afd_ext::")}


def test_every_op_has_its_exact_schema():
    assert set(SCHEMAS) <= _registered()
    for name, schema in SCHEMAS.items():
        assert str(getattr(torch.ops.afd_ext, name).default._schema) == schema, name


def test_no_unlisted_op():
    assert _registered() == set(SCHEMAS)


@pytest.mark.parametrize("name", COMM_OPS)
def test_comm_ops_declare_every_tensor_mutated_and_return_nothing(name):
    schema = getattr(torch.ops.afd_ext, name).default._schema
    assert schema.returns == [] or len(schema.returns) == 0
    tensor_args = [a for a in schema.arguments if "Tensor" in str(a.type)]
    assert tensor_args and all(a.alias_info is not None and a.alias_info.is_write for a in tensor_args)
    alias_sets = [frozenset(a.alias_info.before_set) for a in tensor_args]
    assert len(set(alias_sets)) == len(alias_sets), "distinct alias sets"


@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_every_op_has_a_python_fake(name):
    entry = torch._library.simple_registry.singleton.find(f"afd_ext::{name}")
    assert entry.fake_impl.kernel is not None, f"afd_ext::{name} has no register_fake"


def test_exactly_one_register_fake_per_op_directly_under_its_wrapper():
    import inspect

    src = inspect.getsource(ops)
    fakes = re.findall(r'@torch\.library\.register_fake\("afd_ext::(\w+)"\)', src)
    # The host-side handle calls share one refusing fake, registered in one loop (ops._HOST_CALLS).
    assert sorted(fakes + list(ops._HOST_CALLS)) == sorted(SCHEMAS)
    for name in fakes:
        # The wrapper `def name(` comes before its fake, with no other def in between.
        wrapper = src.index(f"\ndef {name}(")
        fake = src.index(f'@torch.library.register_fake("afd_ext::{name}")')
        between = src[wrapper + 1 : fake]
        assert wrapper < fake and between.count("\ndef ") == 0, name


@pytest.mark.parametrize("name", TENSOR_OPS)
def test_tensor_ops_have_cpu_and_cuda_kernels(name):
    # The CUDA key is registered in every build (a CPU-only build registers
    # stubs that raise "built without CUDA"), so no call falls through to a
    # dispatcher error.
    for key in ("CPU", "CUDA"):
        assert torch._C._dispatch_has_kernel_for_dispatch_key(f"afd_ext::{name}", key), (name, key)


@pytest.mark.parametrize("name", ["nccl_version", "nccl_unique_id", "comm_create", "comm_destroy", "comm_abort",
                                  "comm_async_error", *PEER_MANAGEMENT_OPS])
def test_management_ops_serve_every_key(name):
    assert torch._C._dispatch_has_kernel_for_dispatch_key(f"afd_ext::{name}", "CompositeExplicitAutograd")


def test_build_info_report():
    info = ops.build_info()
    assert set(info) == {"cuda_built", "nccl_compiled", "nccl_runtime", "torch", "torch_cuda", "arch_list"}
    assert info["torch"] == torch.__version__ and info["torch_cuda"] == torch.version.cuda
    assert info["cuda_built"] is ops.is_cuda_built()
    if info["cuda_built"]:
        # NCCL codes are major*10000 + minor*100 + patch; compiled and loaded share the major.
        assert info["nccl_compiled"] >= 21400 and info["nccl_runtime"] >= 21400
        assert info["nccl_compiled"] // 10000 == info["nccl_runtime"] // 10000
        assert info["nccl_runtime"] == ops.nccl_version()
        assert info["arch_list"]
        assert all(re.fullmatch(r"\d+\.\d+[a-z]?(\+PTX)?", a) for a in info["arch_list"].split())
        loaded = torch.cuda.nccl.version()
        loaded_code = loaded[0] * 10000 + loaded[1] * 100 + loaded[2]
        assert info["nccl_runtime"] == loaded_code, "afd_ext and torch must use the same libnccl"
    else:
        assert info["nccl_compiled"] is None and info["nccl_runtime"] is None
        assert ops.nccl_version() == 0




def test_the_python_wire_dtype_table_mirrors_the_extensions():
    # csrc/checks.cpp holds the one table the ops check against; spec.py's copy serves Python callers
    # that run before (or without) the compiled core, so the two are compared here.
    from afd_ext import _C, spec

    native = [n.strip() for n in _C.WIRE_DTYPES.split(",")]
    assert native == [spec.dtype_name(d) for d in spec.WIRE_DTYPES]
    assert ops.WIRE_DTYPES == spec.WIRE_DTYPES


def test_the_fp8_group_is_the_extensions():
    # csrc/peer.h's kFp8Group sizes the kernels' scale groups; afd_ext.fp8 (imported without the compiled
    # core) states it for Python, so the two are compared here.
    from afd_ext import _C, fp8

    assert _C.FP8_GROUP == fp8.GROUP


def test_the_peer_constants_come_from_the_extension():
    # csrc/peer.h states the peer plane's limits and error record once; ops reads them from _C, and the
    # record's decoder must name its words in the same order.
    import dataclasses

    from afd_ext import _C
    from afd_ext.transport.peer.plane import PeerFailure

    assert ops.PEER_ERR_WORDS == tuple(_C.PEER_ERR_WORDS.split(",")) == tuple(
        f.name for f in dataclasses.fields(PeerFailure))
    assert ops.PEER_OK == 0 and len({ops.PEER_OK, ops.PEER_TIMEOUT, ops.PEER_PROTOCOL, ops.PEER_ABORTED}) == 4
