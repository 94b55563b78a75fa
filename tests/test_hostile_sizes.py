"""Sizes and patterns a dump or a mapping file can forge: every allocation bounded by what
the file holds, every pattern by a time, every failure an error naming the file or rule."""

from __future__ import annotations

import json
import time

import pytest
import torch

import tdinspect
from tdinspect import DumpSet
from tdinspect.align.mapping import Mapping
from tdinspect.cli import main
from tdinspect.errors import AlignError, MappingError, ReplayRefused

from .conftest import only_folder, rewrite_sidecar


def _tp2(root):
    """Two ranks of a column-parallel Linear, each its own rank folder of one run."""
    x = torch.randn(2, 8, generator=torch.Generator().manual_seed(0))
    for rank in range(2):
        part = torch.nn.Sequential(torch.nn.Linear(8, 3))
        with (
            torch.no_grad(),
            tdinspect.capture(part, root, parallel={"tp": (rank, 2)}, dims={"0$": "b h(tp)"}) as c,
        ):
            part(x)
            c.step()
    return sorted(p for p in root.iterdir() if p.is_dir())


def test_a_forged_tensor_parallel_size_is_named_at_once(tmp_path, capsys):
    """tp size 10^12 in both ranks' sidecars (re-sealed, as a careful forger would): --unshard
    hung counting shards, then MemoryError. Now the entry says which shard no rank holds."""
    for folder in _tp2(tmp_path / "tp2"):
        sidecar = folder / "pass00000.json"
        doc = json.loads(sidecar.read_text())
        doc["parallel"]["tp"][1] = 10**12
        rewrite_sidecar(sidecar, doc)
    started = time.perf_counter()
    ds = DumpSet.open(tmp_path / "tp2").unshard()
    with pytest.raises(AlignError, match=r"no rank holds tp shard 2 of 1000000000000"):
        ds.tensor("model.0")
    assert main(["diff", str(tmp_path / "tp2"), str(tmp_path / "tp2"), "--unshard"]) in (0, 1, 3)
    assert "shard 2 of 1000000000000" in capsys.readouterr().out
    assert time.perf_counter() - started < 30


def test_a_replay_whose_forged_size_would_allocate_gigabytes_is_refused(tmp_path):
    """aten.new_zeros with its size argument forged to 2^17 x 2^17 (128 GB in float64): replay tried to
    allocate it. Now refused from the sizes a meta run gives, before anything is made."""
    x = torch.arange(4.0)
    with tdinspect.capture_ops(tmp_path, inputs=True) as dump:
        x.new_zeros([2, 2])
        dump.step()
    sidecar = only_folder(tmp_path) / "pass00000.json"
    assert tdinspect.replay(tmp_path, "model/aten.new_zeros.default").outputs  # fair sizes re-run
    doc = json.loads(sidecar.read_text())
    entries = doc["entries"]
    i = entries["key"].index("model/aten.new_zeros.default[out0]")
    leaves = entries["call_args"][i]["leaves"]
    assert leaves[1:3] == [2, 2]
    leaves[1:3] = [2**17, 2**17]
    rewrite_sidecar(sidecar, doc)
    with pytest.raises(ReplayRefused, match=r"pass00000.*would make 137438953472 bytes"):
        tdinspect.replay(tmp_path, "model/aten.new_zeros.default")


def test_a_backtracking_rule_is_stopped_by_a_time_limit_naming_it(tmp_path):
    """The rule m\\.(a|aa)+$ took 40 s on one 43-character name; now about one second, then a
    MappingError naming the rule (and the CLI exits 2 with it)."""
    mapping = Mapping({r"m\.(a|aa)+$": "x", r"m\.b": "y"})
    assert mapping.partner("m.b") == ("y", None)
    started = time.perf_counter()
    with pytest.raises(MappingError, match=r"rule 'm\\\.\(a\|aa\)\+\$': matching .* took more than 1.0 s"):
        mapping.partner("m." + "a" * 40 + "b")
    assert time.perf_counter() - started < 5


def test_a_megabyte_rule_is_quoted_short(tmp_path):
    pattern = "m\\.(" + "|".join(f"x{i}" for i in range(200_000)) + ")("
    with pytest.raises(MappingError) as info:
        Mapping({pattern: "y"})
    assert len(str(info.value)) < 400 and f"({len(pattern)} characters)" in str(info.value)


def test_a_deeply_nested_transform_is_a_mapping_error_naming_the_rule(tmp_path):
    deep = "flatten(" * 100 + "x" + ")" * 100
    with pytest.raises(MappingError, match="rule 'a'"):
        Mapping({"a": ["b", deep]})


def _expanded_pair(tmp_path):
    """A 4-byte storage viewed as 2^17 x 2^17 (64 GB made whole) and an empty entry, both sides."""
    for side in ("a", "b"):
        (tmp_path / side).mkdir()
        tensors = {"model.a": torch.ones(1, 1).expand(2**17, 2**17), "model.e": torch.ones(0, 3)}
        torch.save(tensors, tmp_path / side / "pass00000.pt")
    return DumpSet.open(tmp_path / "a"), tmp_path / "b"


def test_per_position_of_an_expanded_or_empty_entry_says_why_without_allocating(tmp_path):
    """per_position made an expanded entry whole (17 GB asked for) and raised
    'range() arg 3 must not be zero' on an empty one; now each is a KeyError saying why."""
    a, b = _expanded_pair(tmp_path)
    diff = a.diff(b)
    assert diff.first_divergence() is None  # compared as stored, never made whole
    with pytest.raises(KeyError, match=r"an expanded view of 4 bytes that would be 68719476736 bytes"):
        diff.per_position("model.a", 0)
    with pytest.raises(KeyError, match=r"no elements \(shape \[0, 3\]\)"):
        diff.per_position("model.e", 0)


def test_a_transform_that_would_make_an_expanded_view_whole_is_a_structural_reason(tmp_path):
    """A flatten() rule over an expanded entry: a 244 KB dump peaked at 7.2 GB. Now the
    pair's reason says why it was not applied, and nothing is allocated."""
    for side, t in (("a", torch.ones(1).expand(2**34)), ("b", torch.ones(1, 1).expand(2**17, 2**17))):
        (tmp_path / side).mkdir()
        torch.save({"model.a": t}, tmp_path / side / "pass00000.pt")
    a, b = DumpSet.open(tmp_path / "a"), tmp_path / "b"
    div = a.diff(b, mapping={r"model\.a": ["model.a", "flatten(0, 1)"]}).first_divergence()
    assert (
        div is not None
        and div.key == "model.a"
        and "not applied: B is an expanded view of 4 bytes" in div.reason
    )


def test_a_megabyte_rule_that_pairs_nothing_keeps_the_output_small(tmp_path, capsys):
    """A 1.5 MB mapping file made 16 MB of output: its rule was quoted whole in every
    one-sided entry's reason. Now each reason quotes it short."""
    for side in ("a", "b"):
        (tmp_path / side).mkdir()
        torch.save({f"model.l{i}": torch.ones(2) for i in range(20)}, tmp_path / side / "pass00000.pt")
    rule = "model\\.l(?:" + "|".join(f"{i}x{'y' * 40}" for i in range(30_000)) + "|\\d+)"
    # a key this long is a YAML explicit key ("? "); each entry's rule names a B entry that is not there
    target = json.dumps("other.\\g<0>")
    (tmp_path / "map.yaml").write_text(f"? {json.dumps(rule)}\n: {target}\n")
    assert (tmp_path / "map.yaml").stat().st_size > 1_000_000
    rc = main(
        [
            "first-divergence",
            str(tmp_path / "a"),
            str(tmp_path / "b"),
            "--mapping",
            str(tmp_path / "map.yaml"),
        ]
    )
    out = capsys.readouterr()
    assert rc in (1, 3) and len(out.out) + len(out.err) < 20_000, len(out.out)
