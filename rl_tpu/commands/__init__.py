"""The `rl-tpu` command and what only it runs: the demos, `estimate`, `plot`. The top floor: nothing in the
package imports it."""
