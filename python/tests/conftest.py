"""Fixtures: real moe-server processes (CPU engine, free loopback ports), started once per test
session and stopped at its end, and helpers shared by the tests.

The binary is $MOE_SERVER_BIN or build/server/moe-server (moe_offload.local_server); a missing
binary fails the tests rather than skipping them.
"""

import re

import pytest
import torch

from moe_offload.local_server import LocalServer


def _start(tmp_path_factory, name):
    return LocalServer(checkpoint_dir=str(tmp_path_factory.mktemp(name)), cpu_threads=1)


@pytest.fixture(scope="session")
def server(tmp_path_factory):
    srv = _start(tmp_path_factory, "server")
    yield srv
    srv.stop()


@pytest.fixture(scope="session")
def shard_servers(tmp_path_factory):
    servers = [_start(tmp_path_factory, f"shard{i}") for i in range(2)]
    yield servers
    for srv in servers:
        srv.stop()


@pytest.fixture
def layer_name(request):
    """A layer name unique to the test (the servers live for the whole session)."""
    return re.sub(r"[^A-Za-z0-9_]", "_", request.node.name)


def random_routing(tokens, num_experts, top_k, generator):
    """Distinct expert ids per token (int64, as topk gives them) and positive weights."""
    ids = torch.stack([torch.randperm(num_experts, generator=generator)[:top_k]
                       for _ in range(tokens)])
    weights = torch.rand(tokens, top_k, generator=generator) + 0.1
    return ids, weights


def assert_close(actual, expected, what, tol=1e-5):
    """Normalised error |a - e|_max / max(|e|_max, 1e-6) within ``tol`` (fp32 sums in another
    order differ by a few ulps)."""
    actual = actual.detach().float()
    expected = expected.detach().float()
    assert actual.shape == expected.shape, f"{what}: shape {actual.shape} != {expected.shape}"
    scale = max(expected.abs().max().item(), 1e-6)
    err = (actual - expected).abs().max().item() / scale
    assert err <= tol, f"{what}: normalised error {err:.3g} > {tol:g}"
