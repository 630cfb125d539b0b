"""The models: the frozen target (target/), a folder per drafter family (dflash/, dspark/) behind
one registry (registry.py), their training (training/), block attention and the objective."""
