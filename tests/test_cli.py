"""The command line: probe prints the gate decision, demo runs end to end on small shapes."""

import pytest

from dspark_jax.apps import cli
from dspark_jax.draft import memory_gate


def test_probe_prints_the_decision(capsys):
  assert cli.main(["probe", "--max-batch-size", "4", "--vocab", "1000", "--gamma", "3",
                   "--dtype", "bf16", "--rank", "8"]) == 0
  out = capsys.readouterr().out
  assert "mode=AUTO" in out and "need=" in out and "compiled=" in out and "reason:" in out
  # The backend of every variant and bucket, with its reason, and the dispatch table.
  assert "backend per variant and padding bucket:" in out
  assert "  greedy   B=4 " in out and "  sampling B=1 " in out
  assert "default (auto) on a GPU" in out and "hopper preconditions:" in out


def test_probe_names_a_backend_that_cannot_run(capsys):
  # An explicit backend is checked at every bucket: V = 1000 has no 16-column tile.
  with pytest.raises(ValueError, match="^backend 'triton': precondition failed: V has a"):
    cli.main(["probe", "--max-batch-size", "2", "--vocab", "1000", "--gamma", "2", "--backend",
              "triton"])


def test_probe_off_mode(capsys, monkeypatch):
  monkeypatch.setenv(memory_gate.ENV_VAR, "OFF")
  assert cli.main(["probe", "--max-batch-size", "2", "--vocab", "100", "--gamma", "2"]) == 0
  assert "mode=OFF folded_sampling=False" in capsys.readouterr().out


def test_probe_rejects_bad_arguments(capsys):
  with pytest.raises(SystemExit):
    cli.main(["probe", "--max-batch-size", "0", "--vocab", "10", "--gamma", "2"])
  with pytest.raises(SystemExit):
    cli.main(["probe", "--max-batch-size", "2", "--vocab", "10", "--gamma", "2", "--dtype", "int8"])


@pytest.mark.slow
@pytest.mark.parametrize("head", ["vanilla", "rnn"])
def test_sampler_demo_runs_and_paths_agree(capsys, head):
  assert cli.main(["sampler-demo", "--batch-size", "4", "--vocab", "512", "--gamma", "3", "--rank", "16",
                   "--hidden", "32", "--head", head, "--repeats", "2"]) == 0
  out = capsys.readouterr().out
  assert "path: folded-sampling" in out
  assert "eager path gives the same tokens and corrected logits: True" in out
  assert "all-greedy batch path: folded-greedy" in out
