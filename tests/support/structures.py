"""The jobs whose layers pass structures across the cuts (dicts, masks, padded sequences, skips), in process
(tests/engine/test_structures.py) and in processes (tests/service/test_structures.py)."""

from __future__ import annotations

from tests.support.spec import TWO_STAGES, job

MASKED = {"factory": "tests.support.models:masked_mlp", "args": {"width": 16, "blocks": 3}}

DICTS = {"factory": "tests.support.models:dict_items", "args": {"n": 40, "width": 16}}

SEQ = {"factory": "tests.support.models:seq_model", "args": {}}

SENTENCES = {"factory": "tests.support.models:sentences", "args": {}, "collate": "gpipe.builtins:pad_collate"}

# The same models through gpipe.Pipeline, under every schedule and checkpointing mode, are in
# tests/engine/test_pipeline.py. Real processes (tests/service/test_structures.py): the dict case; padded sequences
# whose length changes step to step cross the c10d cut in the masked charlm example's run there.
CASES = {
    # a dict input {"x", "mask"}; bool and int tensors, None and scalars cross every cut
    "dict-mask-1f1b-except_last": job(TWO_STAGES, model=MASKED, stages=2, chunks=4, schedule="1f1b",
                                      activation_checkpoint="except_last", data={**DICTS, "batch_size": 9}),
    # padded sequences whose length changes step to step (a custom collate), 7 = 3+2+2, the mask crossing
    "varlen-1f1b-always": job(TWO_STAGES, model=SEQ, stages=2, balance=[2, 2], chunks=3, schedule="1f1b", steps=5,
                              activation_checkpoint="always", data={**SENTENCES, "batch_size": 7, "shuffle": True},
                              loss="cross_entropy"),
}

SKIPS = {"factory": "tests.support.models:skip_mlp", "args": {"width": 16, "skip_width": 24}}

SKIP_CASES = {
    # s and ids go from stage 0 to stage 3, past stages 1 and 2; s2 from stage 1 to 3; local stays in stage 3
    # (3 stages, 1f1b: tests/engine/test_pipeline.py)
    "skip-4stages-gpipe-always": job(TWO_STAGES, model=SKIPS, stages=4, balance=[1, 1, 1, 3], chunks=4,
                                     activation_checkpoint="always"),
}
