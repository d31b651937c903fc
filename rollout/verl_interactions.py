"""verl's interactions, unchanged: `rollout.env` also takes verl's interaction config file (what verl's
`actor_rollout_ref.rollout.multi_turn.interaction_config_path` names), whose `BaseInteraction` classes
answer each assistant turn in our environment workers.

    interaction:
      - name: gsm8k                                             # optional: from the class name otherwise
        class_name: verl.interactions.gsm8k_interaction.Gsm8kInteraction
        config: {}                                              # given to the class, as verl gives it

Each row picks its interaction by `extra_info.interaction_kwargs.name` (as verl requires; a file with one
interaction needs no name) and the rest of `interaction_kwargs` goes to every call, as verl passes it. A
trajectory runs as verl 0.7's `ToolAgentLoop` runs one: `start_interaction(instance_id, **kwargs)` opens it
(the row's own messages are the prompt), `generate_response(instance_id, messages, **kwargs)` answers each
assistant turn that made no tool call with a user message, or ends the trajectory; its turn score is
recorded (`rollout/env_info/turn_score_mean`: each trajectory's last) and, as in verl, not the reward: the
reward functions score the trajectory's final answer. When the trajectory ends, however it ends,
`finalize_interaction(instance_id)` releases the interaction's state (verl 0.7 never calls it).

The classes are duck-typed: any class with those methods works, with or without verl installed. verl
removed its interactions in 0.8 (our `verl` extra is 0.9.1), so verl's own ones need an older verl
importable in the workers (e.g. on PYTHONPATH). The driver reads the file and checks each `class_name`'s
module can be found without importing it; each environment worker imports and builds the classes once,
with one instance per interaction shared by its trajectories, as verl shares them.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import sys
import uuid
from pathlib import Path
from typing import Any

METHODS = ("start_interaction", "generate_response", "finalize_interaction")


def is_interaction_config(spec: str) -> bool:
    from rl_tpu.rollout.verl_tools import is_tool_config  # the same file suffixes

    return isinstance(spec, str) and is_tool_config(spec.strip())


def resolve(spec: str) -> str:
    """The file's absolute path (the same in any working directory)."""
    return str(Path(spec.strip()).expanduser().resolve())


def _default_name(class_name: str) -> str:
    """verl's rule: the class's name, lower case, without an "Interaction" suffix."""
    simple = class_name.rpartition(".")[2]
    return (simple[: -len("Interaction")] if simple.endswith("Interaction") else simple).lower()


def read_interaction_config(path: str | Path, field_name: str = "rollout.env") -> dict[str, tuple[str, dict]]:
    """The file's interactions by name: (class_name, config with its name), checked for what rl-tpu reads
    (an `EnvError` naming the file and entry otherwise). Neither verl nor the classes are imported."""
    from rl_tpu.rollout.multi_turn import EnvError
    from rl_tpu.rollout.verl_tools import read_config_list

    entries = read_config_list(path, "interaction", field_name, EnvError, "verl's interaction config")
    p = Path(path).expanduser()
    out: dict[str, tuple[str, dict]] = {}
    for i, e in enumerate(entries):
        where = f"{field_name}: {str(p)!r} interaction[{i}]"
        if not isinstance(e, dict) or not isinstance(e.get("class_name"), str) or "." not in e["class_name"]:
            raise EnvError(f"{where} needs class_name ('package.module.Class', a BaseInteraction)")
        config = e.get("config") or {}
        if not isinstance(config, dict):
            raise EnvError(f"{where} ({e['class_name']}): config must be a mapping, got {config!r:.100}")
        name = e.get("name") or _default_name(e["class_name"])
        if name in out:
            raise EnvError(f"{where}: a second interaction named {name!r}; each needs a name of its own")
        out[str(name)] = (e["class_name"], {**config, "name": str(name)})
    return out


def module_found(dotted: str) -> bool:
    """Whether module `dotted` can be found on this process's path, without importing anything (finding
    `verl.interactions.x` the usual way imports verl: seconds, in the driver; and a verl imported here
    already would answer for itself, not for the path the workers search): each level is asked of the
    import system's finders with its parent's search path, as an import would ask them."""
    finders = [f for f in sys.meta_path if callable(getattr(f, "find_spec", None))]
    spec, name, path = None, "", None
    for part in dotted.split("."):
        if name and (spec is None or not spec.submodule_search_locations):
            return False
        if name:
            path = list(spec.submodule_search_locations)
        name = f"{name}.{part}" if name else part
        spec = next((s for f in finders if (s := f.find_spec(name, path)) is not None), None)
    return spec is not None


def _missing_hint(module: str) -> str:
    if module.startswith("verl."):
        return " (verl removed its interactions in 0.8: verl's own need verl <= 0.7.1 importable, e.g. on PYTHONPATH)"
    return " (is its folder on PYTHONPATH, or the package installed?)"


def check_importable(
    path: str, interactions: dict[str, tuple[str, dict]], field_name: str = "rollout.env"
) -> None:
    """Each class_name's module (of `interactions`, the file's as read) can be found here (not imported:
    that is the workers'), else an `EnvError`."""
    from rl_tpu.rollout.multi_turn import EnvError

    for name, (class_name, _) in interactions.items():
        module = class_name.rpartition(".")[0]
        if not module_found(module):
            raise EnvError(
                f"{field_name} {path!r}: interaction {name!r}: module {module!r} of {class_name!r} is not "
                f"importable{_missing_hint(module)}"
            )


def row_interaction(extra_info: dict | None, names: list[str], where: str) -> tuple[str, dict]:
    """The interaction a row names and the kwargs it passes (its `extra_info.interaction_kwargs`), or a
    `ValueError` naming the field."""
    kwargs = (extra_info or {}).get("interaction_kwargs") or {}
    if not isinstance(kwargs, dict):
        raise ValueError(f"{where}: extra_info.interaction_kwargs must be a mapping, got {kwargs!r:.100}")
    name = kwargs.get("name")
    if name is None and len(names) == 1:
        name = names[0]
    if name not in names:
        got = "has no name" if name is None else f"names {name!r}"
        raise ValueError(f"{where}: extra_info.interaction_kwargs {got}; the config has {names}")
    return name, kwargs


def check_rows(path: str, rows: list, field_name: str = "rollout.env") -> None:
    """Every row (an `Example`) names one of the file's interactions (verl's rule), else an `EnvError`
    naming the row."""
    from rl_tpu.rollout.multi_turn import EnvError

    names = list(read_interaction_config(path, field_name))
    for row in rows:
        try:
            row_interaction(row.extra_info, names, f"{field_name} {path!r}: row {row.uid}")
        except ValueError as e:
            raise EnvError(str(e)) from e


def _build(interactions: dict[str, tuple[str, dict]]) -> dict[str, Any]:
    """Each interaction (the file's, as read), constructed with its config (as verl's loader does)."""
    out = {}
    for name, (class_name, config) in interactions.items():
        module, _, cls_name = class_name.rpartition(".")
        try:
            cls = getattr(importlib.import_module(module), cls_name)
        except (ImportError, AttributeError) as e:
            raise ImportError(f"interaction {name!r}: {class_name}: {e}{_missing_hint(module)}") from e
        missing = [m for m in METHODS if not callable(getattr(cls, m, None))]
        if missing:
            raise TypeError(f"interaction {name!r}: {class_name} has no {', '.join(missing)}")
        out[name] = cls(config=config)
    return out


async def _value(result: Any) -> Any:
    """`result`, awaited where it is awaitable (verl's methods are `async`; a duck-typed class's may not be)."""
    return await result if inspect.isawaitable(result) else result


async def _finalize(interaction: Any, instance_id: str) -> None:
    """`finalize_interaction`, with the instance id where it takes one (verl's base class does not)."""
    params = inspect.signature(interaction.finalize_interaction).parameters.values()
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    await _value(
        interaction.finalize_interaction(instance_id) if positional else interaction.finalize_interaction()
    )


class InteractionEnv:
    """A trajectory driven by one of the file's verl interactions, as an rl-tpu environment (reset,
    step, close). `env_class` binds it to a file; `build` constructs the interactions, in the worker."""

    path: str = ""
    configs: dict[str, tuple[str, dict]] = {}  # the file's, by name: (class_name, config)
    interactions: dict[str, Any] | None = None  # by name; built once per process

    @classmethod
    def build(cls) -> None:
        cls.interactions = _build(cls.configs)

    async def reset(self, sample: dict) -> list[dict]:
        if self.interactions is None:
            type(self).build()
        where = f"rollout.env {self.path!r}: row {sample.get('uid')}"
        name, self.kwargs = row_interaction(sample.get("extra_info"), list(self.interactions), where)
        self.interaction, self.instance_id = self.interactions[name], uuid.uuid4().hex
        await _value(self.interaction.start_interaction(self.instance_id, **self.kwargs))
        return list(sample["messages"])

    async def step(self, messages: list[dict]) -> tuple[list[dict], None, bool, dict]:
        answer = await _value(self.interaction.generate_response(self.instance_id, messages, **self.kwargs))
        if not isinstance(answer, (tuple, list)) or len(answer) != 4:
            raise TypeError(
                f"{type(self.interaction).__name__}.generate_response must return (should_terminate, "
                f"response, score, metadata) as verl's BaseInteraction does, got {answer!r:.200}"
            )
        done, text, score, _ = answer
        info = {} if score is None else {"turn_score": float(score)}
        return ([] if done else [{"role": "user", "content": str(text)}]), None, bool(done), info

    async def close(self) -> None:
        if getattr(self, "instance_id", None) is not None:
            await _finalize(self.interaction, self.instance_id)


def env_class(spec: str, field_name: str = "rollout.env") -> type:
    """An `InteractionEnv` class bound to the file `spec` names, checked as the driver checks it (the file
    read, the classes' modules found); its interactions are built by the worker (`build`)."""
    path = resolve(spec)
    configs = read_interaction_config(path, field_name)
    check_importable(path, configs, field_name)
    first = next(iter(configs.values()))[0].rpartition(".")[2]
    name = first if len(configs) == 1 else "VerlInteractions"
    return type(name, (InteractionEnv,), {"path": path, "configs": configs, "interactions": None})
