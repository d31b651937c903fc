"""verl's native tools, unchanged: `rollout.tools` also takes verl's tool config file (what verl's
`actor_rollout_ref.rollout.multi_turn.tool_config_path` names), whose `BaseTool` subclasses run in our tool
workers.

    tools:
      - class_name: my_pkg.calc_tool.CalcTool      # a verl.tools.base_tool.BaseTool subclass
        config: {type: native, penalty: -0.05}      # given to the class, as verl gives it
        tool_schema:                                # the OpenAI function schema the model sees
          type: function
          function: {name: calc, description: ..., parameters: {...}}

`rollout.tools = ["tools.yaml"]` adds every tool the file declares, `"tools.yaml:calc"` one of them (and
plain functions may sit beside them in the list). The schemas come from the file (a tool without
`tool_schema` is a `ToolError`: verl would ask the class, which would mean importing verl in the driver).

Each tool worker builds the tools with verl's own loader (`verl.tools.tool_registry.
initialize_tools_from_config`, in verl 0.7 `verl.tools.utils.tool_registry`'s: the `verl` extra must be
installed, and its import costs the worker ~10 s at start), once. A call runs as verl 0.9.1's
`ToolAgentLoop._call_tool` runs it: `create(create_kwargs=the row's
extra_info.tools_kwargs[name].create_kwargs)`, `execute(instance_id, arguments)`, then
`release(instance_id)` whatever happened; so a tool's state lives for one call, as in verl. The model reads
the response's text; the step reward `execute` returns is the call's `ToolReply.reward`, summed per
trajectory and reported (`rollout/tool_reward`), not added to the score (verl records it in `tool_rewards`
and does not add it either). Differences from verl: `execute` gets `agent_data=None` (verl passes its
`AgentData`, which does not exist here), responses are text only, and the arguments the model wrote are not
checked against the schema (as in verl: the tool decides)."""

from __future__ import annotations

import functools
import importlib.util
import inspect
from pathlib import Path
from typing import Any

CONFIG_SUFFIXES = (".yaml", ".yml")
CREATE_KWARGS = "_rl_tpu_create_kwargs"  # the call's keyword carrying the row's create_kwargs


def is_tool_config(target: str) -> bool:
    return str(target).lower().endswith(CONFIG_SUFFIXES)


def read_config_list(path: str | Path, key: str, field_name: str, error: type, what: str) -> list:
    """The non-empty list under `key` in the YAML file `path` (verl's tool and interaction config files),
    or an `error` naming the file and what is wrong."""
    import yaml

    p = Path(path).expanduser()
    if not p.is_file():
        raise error(f"{field_name}: {what} file {str(p)!r} not found")
    try:
        doc = yaml.safe_load(p.read_text()) or {}
    except yaml.YAMLError as e:
        raise error(f"{field_name}: {str(p)!r} is not valid YAML: {e}") from e
    entries = doc.get(key) if isinstance(doc, dict) else None
    if not isinstance(entries, list) or not entries:
        raise error(f"{field_name}: {str(p)!r} has no `{key}:` list ({what} format)")
    return entries


def read_tool_config(path: str | Path, field_name: str = "rollout.tools") -> list[dict]:
    """The `tools` entries of a verl tool config file, checked for what rl-tpu reads (class_name, a native
    type, tool_schema.function.name); a `ToolError` naming the file and entry otherwise."""
    from rl_tpu.rollout.tools import ToolError

    entries = read_config_list(path, "tools", field_name, ToolError, "verl's tool config")
    p = Path(path).expanduser()
    for i, e in enumerate(entries):
        where = f"{field_name}: {str(p)!r} tools[{i}]"
        if not isinstance(e, dict) or not isinstance(e.get("class_name"), str):
            raise ToolError(f"{where} needs class_name (a BaseTool subclass, 'package.module.Class')")
        kind = (e.get("config") or {}).get("type", "native")
        if kind != "native":
            raise ToolError(
                f"{where} ({e['class_name']}): config.type {kind!r}; only 'native' tools run here"
            )
        name = ((e.get("tool_schema") or {}).get("function") or {}).get("name")
        if not isinstance(name, str) or not name:
            raise ToolError(
                f"{where} ({e['class_name']}): give its tool_schema (type: function, function: {{name, "
                "description, parameters}}) in the file; rl-tpu reads schemas without importing verl"
            )
    return entries


def tool_schemas(
    path: str | Path, field_name: str = "rollout.tools", entries: list[dict] | None = None
) -> dict[str, dict]:
    """Each tool's schema for the chat template's `tools=`, by name, in the file's order (`entries`: the
    file's, already read)."""
    entries = read_tool_config(path, field_name) if entries is None else entries
    return {e["tool_schema"]["function"]["name"]: e["tool_schema"] for e in entries}


def expand(specs: list[str], field_name: str = "rollout.tools") -> list[str]:
    """`specs` with each bare tool config file replaced by one `path:name` spec per tool it declares."""
    out = []
    for spec in specs:
        if is_tool_config(spec):  # no ':name': every tool of the file
            out += [f"{spec}:{name}" for name in tool_schemas(spec, field_name)]
        else:
            out.append(spec)
    return out


@functools.cache
def _tools(path: str) -> dict[str, Any]:
    try:  # verl 0.8 and later
        from verl.tools.tool_registry import initialize_tools_from_config
    except ImportError:  # verl 0.7 and earlier (where its own GSM8K tool lives)
        from verl.tools.utils.tool_registry import initialize_tools_from_config

    return {t.name: t for t in initialize_tools_from_config(path)}


class VerlTool:
    """One verl `BaseTool` as an rl-tpu tool function: the call runs create, execute and release."""

    rl_tpu_row_kwargs = "verl"  # the row's tools_kwargs go to `create`, not to keyword parameters

    def __init__(self, tool: Any, schema: dict):
        self.tool, self.tool_schema = tool, schema
        self.__name__ = schema["function"]["name"]
        self.__doc__ = schema["function"].get("description", "")
        self.__signature__ = inspect.Signature(
            [inspect.Parameter("arguments", inspect.Parameter.VAR_KEYWORD)]
        )

    async def __call__(self, **arguments: Any):
        from rl_tpu.rollout.tools import ToolReply

        create_kwargs = arguments.pop(CREATE_KWARGS, None) or {}
        instance_id, _ = await self.tool.create(create_kwargs=create_kwargs)
        try:
            response, reward, _metrics = await self.tool.execute(instance_id, arguments, agent_data=None)
        finally:
            await self.tool.release(instance_id)
        return ToolReply(str(getattr(response, "text", None) or ""), float(reward or 0.0))


def declared(spec: str, field_name: str = "rollout.tools") -> VerlTool:
    """The tool `spec` ("path.yaml:name") names, as the driver sees it: its schema from the file, no
    verl import (it cannot run: the workers build the real one)."""
    from rl_tpu.rollout.tools import ToolError

    path, _, name = spec.rpartition(":")
    schemas = tool_schemas(path, field_name)
    if name not in schemas:
        raise ToolError(f"{field_name} {spec!r}: {path!r} declares no tool {name!r}; it has {list(schemas)}")
    return VerlTool(None, schemas[name])


def load_spec(spec: str, label: str = "rollout.tools") -> Any:
    """A tool worker's loader (`CallPool(load=...)`): a verl tool config spec ("tools.yaml:name") with
    verl's loader, any other spec as `rl_tpu.user_code.load_callable` does."""
    from rl_tpu.user_code import load_callable, split_spec

    target, name, _ = split_spec(spec, label)
    if is_tool_config(target):
        return load_tool(Path(target).expanduser().resolve(), name, spec, label)
    return load_callable(spec, label)


def load_tool(path: Path, name: str, spec: str, label: str) -> VerlTool:
    """The tool `name` of the verl tool config at `path`, built with verl's loader (a `SpecError` naming
    the spec when it cannot be)."""
    from rl_tpu.user_code import SpecError

    entries = read_tool_config(path, label)
    schemas = tool_schemas(path, label, entries)
    if name not in schemas:
        raise SpecError(f"{label} {spec!r}: {str(path)!r} declares no tool {name!r}; it has {list(schemas)}")
    for e in entries:  # verl's loader fails on a missing module with an AttributeError
        module = e["class_name"].rpartition(".")[0]
        try:
            found = bool(module) and importlib.util.find_spec(module) is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            raise SpecError(
                f"{label} {spec!r}: class_name {e['class_name']!r} in {str(path)!r}: module {module!r} is not "
                "importable (is its folder on PYTHONPATH, or the package installed?)"
            )
    try:
        tools = _tools(str(path))
    except ImportError as e:
        raise SpecError(
            f"{label} {spec!r}: verl's tools need verl installed (the `verl` extra: scripts/setup.sh "
            f"--extra verl): {e}"
        ) from e
    except Exception as e:  # the class's constructor, its import, verl's own checks
        raise SpecError(
            f"{label} {spec!r}: verl could not build the tools of {str(path)!r}: {type(e).__name__}: {e}"
        ) from e
    return VerlTool(tools[name], schemas[name])
