"""Static descriptions of both sides of a weight sync, from which the plan is computed once.

`ParamSpec` is what a trainer rank reports for each parameter (TorchTitan name, global shape, dtype,
DeviceMesh shape and DTensor placements). It is plain data (strings and ints) so it pickles across
Ray actors and Python environments, and importing this module needs torch alone.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class ParamSpec:
    name: str  # TorchTitan fully-qualified parameter name, e.g. "layers.0.attention.wq.weight"
    shape: tuple[int, ...]  # global (unsharded) shape
    dtype: str  # torch dtype name without the "torch." prefix, e.g. "float32"
    mesh_shape: tuple[int, ...]  # DeviceMesh shape, () for a plain (non-DTensor) parameter
    mesh_dim_names: tuple[str, ...]
    placements: tuple[str, ...]  # one per mesh dim: "Shard(0)", "Replicate()", ...
    # the trainer ranks of the DeviceMesh, row-major (`mesh.mesh.flatten()`); empty: ranks 0..n-1 in
    # order. Expert-parallel parameters live on a mesh of their own (TorchTitan's `efsdp` x `ep`)
    mesh_ranks: tuple[int, ...] = ()

    @classmethod
    def from_tensor(cls, name: str, t) -> ParamSpec:
        """Describe a torch.Tensor or DTensor."""
        from torch.distributed.tensor import DTensor

        dtype = str(t.dtype).removeprefix("torch.")
        if isinstance(t, DTensor):
            mesh = t.device_mesh
            return cls(
                name=name,
                shape=tuple(t.shape),
                dtype=dtype,
                mesh_shape=tuple(mesh.shape),
                mesh_dim_names=tuple(mesh.mesh_dim_names or ()),
                placements=tuple(str(p) for p in t.placements),
                mesh_ranks=tuple(int(r) for r in mesh.mesh.flatten().tolist()),
            )
        return cls(
            name=name, shape=tuple(t.shape), dtype=dtype, mesh_shape=(), mesh_dim_names=(), placements=()
        )
