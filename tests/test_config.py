"""Config loading: TOML + overrides, and clear errors naming the key and file, from the CLI too."""

import subprocess
import sys
from pathlib import Path

import pytest

from rl_tpu.config import DEFAULT_CONFIG, Config, ConfigError, load_config, to_toml

REPO = Path(__file__).resolve().parents[1]


def test_default_config_is_the_example():
    assert (REPO / "examples" / "tiny_cpu.toml").read_text() == DEFAULT_CONFIG.read_text()
    cfg = load_config(DEFAULT_CONFIG)
    assert cfg.reward.functions == ["rl_tpu.rewards.arithmetic:compute_score"]
    assert cfg.trainer.world_size == 2


def test_overrides_are_typed_and_applied_in_order(tmp_path):
    f = tmp_path / "c.toml"
    f.write_text('[rollout]\nn = 4\n[logging]\nrun_dir = "runs/a"\n')
    cfg = load_config(f, ["--rollout.n=6", "--logging.run_dir=runs/b", '--reward.functions=["x.py:f", "m:g"]',
                          "--reward.weights=[1, 0.5]", "--trainer.lr=3e-4"])
    assert cfg.rollout.n == 6
    assert cfg.logging.run_dir == "runs/b"
    assert cfg.reward.functions == ["x.py:f", "m:g"]
    assert cfg.reward.weights == [1.0, 0.5] and all(isinstance(w, float) for w in cfg.reward.weights)
    assert cfg.trainer.lr == 3e-4


def test_resolved_config_round_trips(tmp_path):
    cfg = load_config(None, ["--rollout.stop=[\"</answer>\"]", "--algorithm.adv_estimator=rloo"])
    f = tmp_path / "resolved.toml"
    f.write_text(to_toml(cfg))
    assert load_config(f) == cfg
    assert Config() == load_config(None)


@pytest.mark.parametrize(
    "override, words",
    [
        ("--rollout.nn=3", ["unknown key", "rollout.nn", "known keys"]),
        ("--nosuch.key=1", ["unknown section", "nosuch"]),
        ("--rollout.n=many", ["rollout.n", "integer", "'many'"]),
        ("--rollout.n=0", ["rollout.n", ">= 1"]),
        ("--rollout.top_p=1.5", ["rollout.top_p", "<= 1"]),
        ("--trainer.reference=yes", ["trainer.reference", "true or false"]),
        ("--algorithm.adv_estimator=ppo2", ["algorithm.adv_estimator", "grpo"]),
        ("--reward.weights=[1.0, 2.0]", ["reward.weights", "one weight per function"]),
        ("--cluster.mode=async", ["cluster.mode", "disaggregated"]),
    ],
)
def test_bad_overrides_name_the_key(override, words):
    with pytest.raises(ConfigError) as e:
        load_config(DEFAULT_CONFIG, [override])
    for w in words:
        assert w in str(e.value), (w, str(e.value))


def test_model_dtype_is_the_precision_switch_of_both_roles():
    from rl_tpu.config import engine_config, resolved_dtype

    cfg = load_config(DEFAULT_CONFIG, ["--model.dtype=bfloat16"])
    assert resolved_dtype(cfg.trainer.param_dtype, cfg) == "bfloat16" and engine_config(cfg).dtype == "bfloat16"
    assert cfg.trainer.reduce_dtype == "float32"  # gradients reduce in fp32 over fp32 master weights
    mixed = load_config(DEFAULT_CONFIG, ["--model.dtype=bfloat16", "--rollout.dtype=float32"])
    assert engine_config(mixed).dtype == "float32"  # a role's own key wins over "auto"
    assert engine_config(load_config(DEFAULT_CONFIG)).dtype == "float32"


def test_rollout_is_needs_the_engines_log_probs():
    load_config(DEFAULT_CONFIG, ["--algorithm.rollout_is=token"])  # computed by default
    with pytest.raises(ConfigError, match=r"rollout_is = \"token\".*rollout.calculate_log_probs = true"):
        load_config(DEFAULT_CONFIG, ["--rollout.calculate_log_probs=false", "--algorithm.rollout_is=token"])


def test_bad_file_names_the_file_and_key(tmp_path):
    f = tmp_path / "bad.toml"
    f.write_text("[trainer]\nlr = \"fast\"\n")
    with pytest.raises(ConfigError, match=r"in .*bad\.toml.*trainer\.lr.*number"):
        load_config(f)
    g = tmp_path / "broken.toml"
    g.write_text("[trainer\n")
    with pytest.raises(ConfigError, match=r"broken\.toml.*not valid TOML"):
        load_config(g)
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "missing.toml")


def _cli(*args, cwd=None):
    return subprocess.run([sys.executable, "-m", "rl_tpu.cli", *args], capture_output=True, text=True, cwd=cwd)


def test_cli_config_show_and_errors(tmp_path):
    ok = _cli("config", "show", str(DEFAULT_CONFIG), "--rollout.n=3")
    assert ok.returncode == 0, ok.stderr
    assert "[rollout]" in ok.stdout and "n = 3" in ok.stdout
    f = tmp_path / "bad.toml"
    f.write_text("[rollout]\ntemprature = 0.5\n")
    for args, words in [
        (("config", "show", str(f)), ["bad.toml", "rollout.temprature", "unknown key"]),
        (("config", "show", "--rollout.n=x"), ["rollout.n", "integer"]),
        (("config", "show", "--rollout.temperature=-1"), ["rollout.temperature", ">= 0"]),
        (("config", "show", "--rollout.n"), ["--section.key=value"]),
    ]:
        r = _cli(*args)
        assert r.returncode == 2, (args, r.stdout, r.stderr)
        for w in words:
            assert w in r.stderr, (w, r.stderr)
        assert "Traceback" not in r.stderr
