"""scripts/profile_layer.py: XLA operations are summed by the layer part they come from."""

import json

import pytest

from sbm_jax._scopes import EDGE_KERNEL, PARTS, SAMPLE, STE_BACKWARD
from tests.scripts_testing import load_script


@pytest.fixture(scope="module")
def prof():
    return load_script("profile_layer")


_ROWS = [  # (instruction, opcode, op_name or None)
    ("while.3", "while", None),
    ("gather.1", "gather", "jvp(SBMAttention)/cond/checkpoint/sbm_sample/while/body/gather"),
    ("sort.2", "sort", "jvp(SBMAttention)/sbm_sample/sort"),
    ("fusion.4", "fusion", "transpose(jvp(SBMAttention))/cond/sbm_ste_backward/while/mul"),
    ("fusion.5", "fusion", "transpose(jvp(SBMAttention))/sbm_edge_kernel/while/body/mul"),
    ("fusion.6", "fusion", "jvp(SBMAttention)/sbm_plan/sbm_edge_kernel/add"),
    ("dot.7", "dot", "jvp(SBMAttention)/out/dot_general"),
    ("copy.8", "copy", None),
]
HLO = (
    "ENTRY %main (p: f32[4]) -> f32[4] {\n  %p = f32[4]{0} parameter(0)\n"
    + "".join(
        f"  %{name} = f32[8]{{0}} {code}(%x), kind=kLoop"
        + (f', metadata={{op_name="jit(loss)/{op}" stack_frame_id=1}}' if op else "")
        + "\n"
        for name, code, op in _ROWS
    )
    + "}\n"
)


def _event(op, dur_us):
    return {"ph": "X", "name": op, "dur": dur_us, "args": {"hlo_op": op}}


def test_operations_are_summed_by_part_and_direction(prof):
    table = prof.hlo_op_names(HLO)
    assert table["gather.1"][0] == "gather" and table["while.3"][0] == "while"
    assert table["copy.8"] == ("copy", "")
    assert table["sort.2"] == ("sort", "jit(loss)/jvp(SBMAttention)/sbm_sample/sort")
    events = [
        _event("gather.1", 3000.0),
        _event("gather.1", 1000.0),
        _event("sort.2", 2000.0),
        _event("fusion.4", 4000.0),
        _event("fusion.5", 6000.0),
        _event("fusion.6", 500.0),  # innermost scope wins: edge kernel, not plan
        _event("dot.7", 1500.0),
        _event("copy.8", 1000.0),
        _event("while.3", 99000.0),  # a container: its children carry the time
        {"ph": "X", "name": "ThunkExecutor::Execute", "dur": 5e5, "args": {}},
        {"ph": "i", "name": "marker"},
    ]
    report = prof.summarize(events, table, calls=2, top=3)
    parts = {row["part"]: row for row in report["parts"]}
    assert parts[SAMPLE]["forward_ms"] == pytest.approx(3.0)  # (3 + 1 + 2) ms / 2 calls
    assert parts[SAMPLE]["backward_ms"] == 0.0
    assert parts[STE_BACKWARD]["backward_ms"] == pytest.approx(2.0)
    assert parts[EDGE_KERNEL]["forward_ms"] == pytest.approx(0.25)
    assert parts[EDGE_KERNEL]["backward_ms"] == pytest.approx(3.0)
    assert parts[prof.REST]["forward_ms"] == pytest.approx(0.75)
    assert parts[prof.UNATTRIBUTED]["forward_ms"] == pytest.approx(0.5)
    assert report["op_time_ms"] == pytest.approx(9.5)
    assert sum(row["share"] for row in report["parts"]) == pytest.approx(1.0)
    assert [op["ms"] for op in report["top_ops"]] == pytest.approx([3.0, 2.0, 2.0])


_CHAIN = """ENTRY %main (p: f32[4]) -> f32[4] {
  %p = f32[4]{0} parameter(0)
  %copy.1 = f32[4]{0} copy(%p)
  %dot.2 = f32[4,1]{1,0} dot(%copy.1, %p), lhs_batch_dims={0}, rhs_batch_dims={0}
  %fusion.3 = f32[4]{0} fusion(%dot.2, %p), kind=kLoop, calls=%fused.1, metadata={op_name="jit(loss)/transpose(jvp(SBMAttention))/sbm_edge_kernel/while/body/exp" stack_frame_id=3}
  %copy.4 = f32[4]{0} copy(%p)
  ROOT %add.5 = f32[4]{0} add(%fusion.3, %p), metadata={op_name="jit(loss)/jvp(SBMAttention)/out/add"}
}
"""  # noqa: E501


def test_operations_without_metadata_take_their_users_names(prof):
    # XLA drops the metadata on some instructions it creates (the rows kernel's batched
    # einsum dots): they count with the first user that has a name, through chains of
    # unnamed ones, so the kernel's backward dots land in the kernel's backward.
    table = prof.hlo_op_names(_CHAIN)
    kernel = "jit(loss)/transpose(jvp(SBMAttention))/sbm_edge_kernel/while/body/exp"
    assert table["dot.2"] == ("dot", kernel)
    assert table["copy.1"] == ("copy", kernel)  # its user (dot.2) had none either
    assert table["copy.4"] == ("copy", "")  # no user: still unattributed
    assert table["add.5"] == ("add", "jit(loss)/jvp(SBMAttention)/out/add")
    report = prof.summarize([_event("dot.2", 2000.0), _event("copy.4", 1000.0)], table, 1)
    parts = {row["part"]: row for row in report["parts"]}
    assert parts[EDGE_KERNEL]["backward_ms"] == pytest.approx(2.0)
    assert parts[prof.UNATTRIBUTED]["forward_ms"] == pytest.approx(1.0)


@pytest.mark.slow
def test_the_sparse_layer_profile_has_each_sparse_part(prof, tmp_path, capsys):
    out = tmp_path / "prof.json"
    # The bucketed path (fastRG in XLA, the rows kernel): on CPU kernel="auto" is the
    # fused kernel, one FFI call with no XLA parts inside.
    args = ["--n", "512", "--density", "0.05", "--repeats", "1", "--json", str(out)]
    prof.main([*args, "--layer-options", "kernel=rows"])
    report = json.loads(out.read_text())
    assert report["info"]["path"] < 3  # a sparse bucket, not the dense path
    parts = {row["part"]: row for row in report["parts"]}
    for part in PARTS[:3]:  # memberships, plan, fastRG
        assert parts[part]["forward_ms"] > 0
    assert parts[EDGE_KERNEL]["forward_ms"] > 0 and parts[EDGE_KERNEL]["backward_ms"] > 0
    assert parts[STE_BACKWARD]["backward_ms"] > 0 and parts[STE_BACKWARD]["forward_ms"] == 0
    total = sum(r["forward_ms"] + r["backward_ms"] for r in report["parts"])
    assert total == pytest.approx(report["op_time_ms"])
    assert "sbm_ste_backward" in capsys.readouterr().out
