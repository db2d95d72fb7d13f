"""The option rules `JobSpec` and `gpipe.Pipeline` share: which schedule, virtual stages and micro-batches go together.

Both the service's spec (gpipe.coordinator.spec.job) and the in-process pipeline ask
`violation`, so a combination one refuses the other refuses too, with the same
message naming the field. The names of the schedules are gpipe.schedule's table
(`schedule.Name`), or a table of actions (gpipe.schedule.table: checked whole, gpipe.measured.check), of the
checkpointing modes `Checkpoint`'s.
"""

from __future__ import annotations

from typing import Literal, get_args

from gpipe import schedule as schedules

Checkpoint = Literal["always", "except_last", "never"]  # activation checkpointing: which micro-batches recompute
CHECKPOINTS: tuple[str, ...] = get_args(Checkpoint)


def violation(schedule: str, stages: int, virtual_stages: int, chunks: int,
              activation_checkpoint: str = "never") -> str | None:
    """The first rule these options break, as "field: why"; None when they go together.

    `stages`: workers per replica; `virtual_stages`: model chunks per worker; `chunks`: micro-batches per step
    (per replica).
    """
    if type(chunks) is not int or chunks < 1:
        return f"chunks: must be a positive int, got {chunks!r}"
    if schedule not in schedules.REGISTRY:
        return f"schedule: {schedule!r} is not one of {', '.join(schedules.names())}"
    if type(virtual_stages) is not int or virtual_stages < 1:
        return f"virtual_stages: must be a positive int, got {virtual_stages!r}"
    if schedules.is_table(schedule):  # a table of actions (gpipe.measured): whole, and of this shape
        from gpipe import measured  # here: it asks this module about the fixed schedules

        if why := measured.problem(schedule, stages, virtual_stages, chunks):
            return why
    record = schedules.REGISTRY[schedule]  # its own rules
    if virtual_stages > 1 and record.model_chunks == (1,):
        return (f"virtual_stages: {virtual_stages} model chunks per worker need schedule "
                f"{' or '.join(schedules.several_chunks())}, not {schedule}")
    if record.model_chunks is None and virtual_stages == 1:  # any number of chunks but one: that is 1f1b
        return (f"virtual_stages: {schedule} interleaves several model chunks per worker: set virtual_stages "
                f"to 2 or more (1 would be plain 1f1b)")
    if record.model_chunks is not None and virtual_stages not in record.model_chunks:
        return (f"virtual_stages: {schedule} holds {' or '.join(map(str, record.model_chunks))} model chunks per "
                f"worker{' (a V)' if record.v_shape else ''}, not {virtual_stages}")
    if record.rounds and virtual_stages > 1 and chunks % stages:
        return (f"chunks: {schedule} runs the micro-batches in rounds of the {stages} workers: {chunks} is "
                f"not a multiple of {stages}")
    if chunks < record.min_rounds * stages:
        return (f"chunks: {schedule} takes at least {record.min_rounds} rounds of the {stages} workers' "
                f"micro-batches: {record.min_rounds * stages} or more, not {chunks}")
    if activation_checkpoint not in CHECKPOINTS:
        return f"activation_checkpoint: {activation_checkpoint!r} is not one of {', '.join(CHECKPOINTS)}"
    return None
