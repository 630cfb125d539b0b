"""The OOM levers: one vocabulary of config keys and one rule for a smaller size."""

from dflash_core.config import Config, key_value
from dflash_core.levers import (
    FIT_LEVERS, HS_QUEUE, LOSS_CHUNK, MAX_SEQS, MICRO_BLOCK_TOKENS, MIN_LOSS_CHUNK, OOM_LEVERS,
    TOKEN_BUDGET, halve, oom_advice,
)


def test_halve_stops_at_its_floor():
    assert halve(64, 1) == 32
    assert halve(3, 1) == 1
    assert halve(5, 4) == 4  # never below the floor
    assert halve(1, 1) is None and halve(0, 1) is None  # nothing smaller to try


def test_every_lever_is_a_config_key():
    cfg = Config()
    for levers in (*OOM_LEVERS.values(), *FIT_LEVERS.values()):
        for lever in levers:
            assert isinstance(key_value(cfg, lever.key), int), lever.key


def test_each_lever_lowers_by_its_rule_down_to_its_floor():
    cfg = Config()
    cfg.data.max_length, cfg.data.token_budget = 1024, 4096
    assert TOKEN_BUDGET.lower(cfg) == 2048
    cfg.data.token_budget = 1500
    assert TOKEN_BUDGET.lower(cfg) == 1024  # a batch holds at least one longest sequence
    cfg.data.token_budget = 1024
    assert TOKEN_BUDGET.lower(cfg) is None
    cfg.layout.hs_queue = 3
    assert HS_QUEUE.lower(cfg) == 2  # a count: one at a time
    cfg.layout.hs_queue = 1
    assert HS_QUEUE.lower(cfg) is None
    cfg.drafter.loss_chunk = MIN_LOSS_CHUNK * 3
    assert LOSS_CHUNK.lower(cfg) == MIN_LOSS_CHUNK * 3 // 2
    cfg.drafter.num_anchors, cfg.drafter.block_size = 100, 8
    cfg.drafter.micro_block_tokens = 1000
    # a sequence's anchors go in smaller passes, down to ANCHOR_PAD (64) blocks of 8
    assert MICRO_BLOCK_TOKENS.lower(cfg) == 512
    cfg.drafter.micro_block_tokens = 512
    assert MICRO_BLOCK_TOKENS.lower(cfg) is None
    cfg.drafter.num_anchors, cfg.drafter.micro_block_tokens = 40, 1000
    assert MICRO_BLOCK_TOKENS.lower(cfg) == 500  # fewer blocks than that: one sequence's 40
    cfg.drafter.micro_block_tokens = 320
    assert MICRO_BLOCK_TOKENS.lower(cfg) is None
    assert MAX_SEQS.lower(cfg) is None  # named in a hint, never lowered by preflight


def test_the_oom_advice_of_a_role_names_its_levers():
    assert oom_advice("drafter") == ("drafter.micro_block_tokens (block tokens per drafter "
                                     "forward) or drafter.loss_chunk (block tokens per chunk of "
                                     "the loss's logits)")
    assert oom_advice("telemetry").startswith("data.token_budget")  # any other role
