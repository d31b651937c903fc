"""Config loading: TOML + overrides, and clear errors naming the key and file, from the CLI too."""

import subprocess
import sys
from pathlib import Path

import pytest

from rl_tpu.config import DEFAULT_CONFIG, Config, ConfigError, load_config, to_toml

REPO = Path(__file__).resolve().parents[2]


def test_default_config_is_the_example():
    # one source: the example is a symlink to the packaged default (docs/decisions.md), not a copy
    example = REPO / "examples" / "tiny_cpu.toml"
    assert example.is_symlink() and example.resolve() == DEFAULT_CONFIG.resolve()
    assert example.read_text() == DEFAULT_CONFIG.read_text()
    cfg = load_config(DEFAULT_CONFIG)
    assert cfg.reward.functions == ["rl_tpu.rewards.arithmetic:compute_score"]
    assert cfg.trainer.world_size == 2


def test_overrides_are_typed_and_applied_in_order(tmp_path):
    f = tmp_path / "c.toml"
    f.write_text('[rollout]\nn = 4\n[logging]\nrun_dir = "runs/a"\n')
    cfg = load_config(
        f,
        [
            "--rollout.n=6",
            "--logging.run_dir=runs/b",
            '--reward.functions=["x.py:f", "m:g"]',
            "--reward.weights=[1, 0.5]",
            "--trainer.lr=3e-4",
        ],
    )
    assert cfg.rollout.n == 6
    assert cfg.logging.run_dir == "runs/b"
    assert cfg.reward.functions == ["x.py:f", "m:g"]
    assert cfg.reward.weights == [1.0, 0.5] and all(isinstance(w, float) for w in cfg.reward.weights)
    assert cfg.trainer.lr == 3e-4


def test_resolved_config_round_trips(tmp_path):
    cfg = load_config(None, ['--rollout.stop=["</answer>"]', "--algorithm.adv_estimator=rloo"])
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
    assert (
        resolved_dtype(cfg.trainer.param_dtype, cfg) == "bfloat16" and engine_config(cfg).dtype == "bfloat16"
    )
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
    f.write_text('[trainer]\nlr = "fast"\n')
    with pytest.raises(ConfigError, match=r"in .*bad\.toml.*trainer\.lr.*number"):
        load_config(f)
    g = tmp_path / "broken.toml"
    g.write_text("[trainer\n")
    with pytest.raises(ConfigError, match=r"broken\.toml.*not valid TOML"):
        load_config(g)
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "missing.toml")


def _cli(*args, cwd=None):
    return subprocess.run(
        [sys.executable, "-m", "rl_tpu.commands.cli", *args], capture_output=True, text=True, cwd=cwd
    )


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


def _list_keys() -> list[tuple[str, type]]:
    """Every list-typed key of the config as (`section.key`, item type), read from the dataclasses."""
    import dataclasses
    import typing

    out = []
    for section, section_tp in typing.get_type_hints(Config).items():
        for f in dataclasses.fields(section_tp):
            tp = typing.get_type_hints(section_tp)[f.name]
            if typing.get_origin(tp) is list:
                out.append((f"{section}.{f.name}", typing.get_args(tp)[0]))
    return out


# one valid single value (as typed on the command line: a bare string needs no quotes), the same value as
# a TOML list item, and what the key must hold, per item type
_SINGLE = {
    str: ("x.parquet", '"x.parquet"', ["x.parquet"]),
    int: ("7", "7", [7]),
    float: ("0.5", "0.5", [0.5]),
}
# a value of the wrong type for each item type: still an error
_WRONG = {str: "5", int: "'seven'", float: "true"}


def test_every_list_key_is_covered():
    keys = dict(_list_keys())
    # the keys this test was written against: a new list key must land in one of the item types above
    assert {"data.train_files", "data.test_files", "reward.functions", "trainer.betas"} <= set(keys)
    assert set(keys.values()) <= set(_SINGLE), keys


@pytest.mark.parametrize("key, item_tp", _list_keys())
def test_list_keys_take_a_single_value(key, item_tp):
    raw, as_item, expected = _SINGLE[item_tp]
    section, name = key.split(".")
    overrides = [f"--{key}={raw}"]
    if key == "reward.weights":  # one weight per function: one function, one weight
        overrides = ["--reward.functions=m:f", *overrides]
    cfg = load_config(DEFAULT_CONFIG, overrides)
    got = getattr(getattr(cfg, section), name)
    assert got == expected and type(got[0]) is item_tp, (key, got)
    # the list form still works and means the same
    assert load_config(DEFAULT_CONFIG, [*overrides[:-1], f"--{key}=[{as_item}]"]) == cfg


@pytest.mark.parametrize("key, item_tp", _list_keys())
def test_list_keys_still_reject_wrong_types(key, item_tp):
    with pytest.raises(ConfigError) as e:
        load_config(DEFAULT_CONFIG, [f"--{key}={_WRONG[item_tp]}"])
    msg = str(e.value)
    assert f"`{key}` must be a list (or a single" in msg and "got" in msg, msg
    with pytest.raises(ConfigError, match=rf"`{key}` must be a list"):
        load_config(DEFAULT_CONFIG, [f"--{key}={{a = 1}}"])  # a table is never a list item here


def test_single_value_from_a_toml_file(tmp_path):
    f = tmp_path / "verl_style.toml"
    f.write_text(
        '[data]\ntrain_files = "~/data/gsm8k/train.parquet"\ntest_files = ["a.parquet", "b.parquet"]\n'
    )
    cfg = load_config(f)
    assert cfg.data.train_files == ["~/data/gsm8k/train.parquet"]
    assert cfg.data.test_files == ["a.parquet", "b.parquet"]
    g = tmp_path / "bad.toml"
    g.write_text("[data]\ntrain_files = 3\n")
    with pytest.raises(
        ConfigError, match=r"bad\.toml.*`data.train_files` must be a list \(or a single string\), got int 3"
    ):
        load_config(g)


def test_expert_parallel_must_divide_world_size():
    with pytest.raises(
        ConfigError, match=r"trainer.expert_parallel = 3. must divide .trainer.world_size = 4"
    ):
        load_config(None, ["--trainer.world_size=4", "--trainer.expert_parallel=3"])
    assert (
        load_config(None, ["--trainer.world_size=4", "--trainer.expert_parallel=2"]).trainer.expert_parallel
        == 2
    )


# ---------------------------------------------------------------------------------------------------
# `extends`: a base file plus a small file on top (the recipes' base + hardware layout)


def _write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def test_extends_two_levels_child_over_base_overrides_over_both(tmp_path):
    _write(tmp_path / "root.toml", '[rollout]\nn = 2\ntemperature = 0.5\n[logging]\nrun_dir = "runs/root"\n')
    _write(tmp_path / "mid.toml", 'extends = "root.toml"\n[rollout]\nn = 4\nmax_tokens = 32\n')
    leaf = _write(tmp_path / "leaf.toml", 'extends = "mid.toml"\n[rollout]\nmax_tokens = 64\n')
    cfg = load_config(leaf)
    assert cfg.rollout.n == 4  # mid over root
    assert cfg.rollout.max_tokens == 64  # leaf over mid
    assert cfg.rollout.temperature == 0.5  # root's, untouched by both
    assert cfg.logging.run_dir == "runs/root"
    cfg = load_config(leaf, ["--rollout.max_tokens=16", "--rollout.temperature=1.0"])
    assert (cfg.rollout.max_tokens, cfg.rollout.temperature, cfg.rollout.n) == (16, 1.0, 4)


def test_extends_a_table_in_both_keeps_the_base_keys(tmp_path):
    _write(tmp_path / "base.toml", "[trainer]\nlr = 1e-5\nworld_size = 2\nwarmup_steps = 7\n")
    child = _write(tmp_path / "child.toml", 'extends = "base.toml"\n[trainer]\nworld_size = 4\n')
    cfg = load_config(child)
    assert (cfg.trainer.world_size, cfg.trainer.lr, cfg.trainer.warmup_steps) == (4, 1e-5, 7)
    # the resolved config (what `rl-tpu config show` prints) has the base's keys and no `extends`
    text = to_toml(cfg)
    assert "extends" not in text and "warmup_steps = 7" in text and "world_size = 4" in text


def test_extends_is_relative_to_the_extending_file_not_the_cwd(tmp_path, monkeypatch):
    _write(tmp_path / "shared" / "base.toml", "[rollout]\nn = 3\n")
    _write(tmp_path / "recipes" / "sub" / "base.toml", "[rollout]\nn = 5\n")  # a decoy next to the cwd's
    child = _write(tmp_path / "recipes" / "child.toml", 'extends = "../shared/base.toml"\n')
    elsewhere = tmp_path / "recipes" / "sub"
    monkeypatch.chdir(elsewhere)
    assert load_config(child).rollout.n == 3
    monkeypatch.chdir(tmp_path)
    assert load_config(Path("recipes") / "child.toml").rollout.n == 3  # a relative path to the child


def test_extends_missing_base_names_both_files(tmp_path):
    child = _write(tmp_path / "child.toml", 'extends = "base/nope.toml"\n')
    with pytest.raises(ConfigError) as e:
        load_config(child)
    msg = str(e.value)
    assert str(child) in msg and str(tmp_path / "base" / "nope.toml") in msg and "does not exist" in msg


def test_extends_cycle_names_the_chain(tmp_path):
    a = _write(tmp_path / "a.toml", 'extends = "b.toml"\n')
    _write(tmp_path / "b.toml", 'extends = "a.toml"\n')
    with pytest.raises(ConfigError, match="cycle") as e:
        load_config(a)
    assert f"{a} -> {tmp_path / 'b.toml'} -> {a}" in str(e.value)
    itself = _write(tmp_path / "self.toml", 'extends = "self.toml"\n')
    with pytest.raises(ConfigError, match=r"self\.toml.*cycle"):
        load_config(itself)


def test_extends_must_be_a_top_level_string(tmp_path):
    f = _write(tmp_path / "num.toml", "extends = 3\n")
    with pytest.raises(ConfigError, match=r"num\.toml: `extends` must be a string.*got int 3"):
        load_config(f)
    g = _write(tmp_path / "in_table.toml", '[trainer]\nextends = "base.toml"\n')
    with pytest.raises(ConfigError, match=r"in_table\.toml: `extends` must be a top-level key.*\[trainer\]"):
        load_config(g)


def test_extends_base_errors_name_the_base(tmp_path):
    _write(tmp_path / "base.toml", "[rollout]\nnn = 3\n")
    child = _write(tmp_path / "child.toml", 'extends = "base.toml"\n')
    with pytest.raises(ConfigError, match=r"in .*base\.toml: unknown key `rollout\.nn`"):
        load_config(child)


def test_every_recipe_resolves_with_its_own_device_and_run_dir():
    recipes = sorted((REPO / "examples" / "recipes").glob("*.toml"))  # the hardware files, not base/
    assert len(recipes) >= 9 and not any(r.parent.name == "base" for r in recipes)
    run_dirs = set()
    for recipe in recipes:
        cfg = load_config(recipe)
        assert cfg.trainer.device in ("tpu", "cuda"), recipe
        assert cfg.model.path and cfg.logging.run_dir, recipe
        run_dirs.add(cfg.logging.run_dir)
    assert len(run_dirs) == len(recipes)


def test_engine_start_timeout_follows_the_engine_package_unless_set():
    """A cold vLLM-TorchTPU start compiles an XLA program per padded shape: its engines get 1800 s to
    start, others 600 s; `rollout.start_timeout_s` overrides both, never below the call timeout."""
    from rl_tpu.rollout.engine import engine_start_timeout

    assert engine_start_timeout(load_config(None, [])) == 600.0
    assert engine_start_timeout(load_config(None, ["--trainer.device=tpu", "--rollout.device=tpu"])) == 1800.0
    assert engine_start_timeout(load_config(None, ["--rollout.start_timeout_s=2400"])) == 2400.0
    assert engine_start_timeout(load_config(None, ["--rollout.start_timeout_s=60"])) == 600.0  # timeout_s
