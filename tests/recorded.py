"""Dumps written by tdinspect's own Recorder (sidecars and all) from ``{key: tensor}`` passes."""

from __future__ import annotations

from tdinspect.dumper.recorder import Recorder


def record_dump(root, passes: list[dict], **recorder_options):
    """``root`` holding one rank's passes, each ``{key: tensor}`` recorded in order (keys may
    name calls: ``"m.attn::call1"``)."""
    rec = Recorder(root, level="module", **recorder_options)
    for entries in passes:
        for key, t in entries.items():
            rec.record(key, t, module_type="Linear")
        rec.step()
    rec.close()
    return root


def capture_llama(config, ids, folder=None, change=None, dtype=None, steps=2, **live):
    """A tiny HF Llama built from ``config`` (seeded random weights, ``dtype``), one of its
    parameters (``change``) scaled by 1.01, run ``steps`` times on ``ids`` under
    ``tdinspect.capture``: the dump ``folder``, or with ``live`` options (``compare_to``...)
    live comparison's table."""
    import torch
    import transformers

    import tdinspect

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = transformers.LlamaForCausalLM(config).eval().to(dtype or torch.float32)
    if change:
        with torch.no_grad():
            model.get_parameter(change).mul_(1.01)
    with tdinspect.capture(model, folder, **live) as cap, torch.no_grad():
        for _ in range(steps):
            model(ids)
            cap.step()
    return cap.live.table() if live else folder
