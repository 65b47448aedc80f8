"""PyTorch's own operator samples (OpInfo) against the kernel registry, on the simulated device.

Every ATen op of ``kernels/registry.py`` is mapped to the OpInfos that exercise it
(``opinfo_cases.candidates``: by name, else by what an eager sample dispatches), so a newly registered
op is covered without editing this file. The first three OpInfos of each op give a few samples:
three in fp32, two in fp16 (or bf16) and one in an integer type where the op takes them. They are
exported and lowered with the project's partitioner, 64 samples to a module, and run twice: as
sampled, and with NaN, inf and -inf in every floating input. Every output is compared with eager at
torch.testing's per-dtype tolerances (``opinfo_cases``). ``scripts/opinfo_all.py`` runs every sample
and prints a table per kernel family.
"""

from __future__ import annotations

import pytest
import torch

import opinfo_cases as oc
from tritondelegate.partitioner import op_name

CI_SAMPLES = {torch.float32: 3, torch.float16: 2, torch.bfloat16: 2, "int": 1}
CI_INFOS = 3  # OpInfos per registry op, the plainest first

# Failures that are not the kernels', (OpInfo id, dtype) -> why; an entry that stops failing fails the test.
KNOWN: dict = {}
# Samples left to scripts/opinfo_all.py: OpInfo id -> the most input elements run here. The ranking
# kernel compares every pair of a row: an 8000-element sort takes about 11 s under the interpreter (its
# long rows are covered by test_ranking.py at a few hundred elements).
MAX_NUMEL = {"sort": 1024}


@pytest.fixture(scope="module")
def runs() -> list[oc.Sample]:
    infos = {oc.info_id(i): i for target in oc.targets() for i in oc.candidates(target)[:CI_INFOS]}
    return oc.run_infos(list(infos.values()), CI_SAMPLES, alone=frozenset(KNOWN), max_numel=MAX_NUMEL)


def test_claimed_samples_match_eager_with_and_without_nan_and_inf(runs):
    failed = [r for r in runs if r.failed and (r.info, r.dtype) not in KNOWN]
    assert not failed, "\n".join(map(str, failed))
    ran = {(r.info, r.dtype) for r in runs}
    stale = [key for key in KNOWN if key in ran and not any(r.failed for r in runs if (r.info, r.dtype) == key)]
    assert not stale, f"known failures that now pass (drop them from KNOWN): {stale}"


def test_every_refused_node_carries_a_reason(runs):
    silent = [(str(r), node, op) for r in runs for node, op, reason in r.refused if not reason]
    assert not silent, silent


def test_samples_reach_and_run_the_registry_kernels(runs):
    # most registry ops are claimed by some sample; each family of kernels runs some sample
    claimed = {t for r in runs if r.status == "matched" for t in r.claimed}
    assert len(claimed) >= len(oc.targets()) // 2, sorted(map(op_name, claimed))
    families = {oc.family(t) for t in oc.targets()}
    assert families <= {oc.family(t) for t in claimed}, sorted(families - {oc.family(t) for t in claimed})
