"""`python -m rl_tpu.data arithmetic --out data/arith`: write a synthetic task's train/test splits in verl's schema."""

from rl_tpu.data.synthetic import main

raise SystemExit(main())
