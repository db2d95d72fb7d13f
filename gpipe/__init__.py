"""gpipe: what the coordinator and the workers share (schedules, factories, RNG, networking)."""
