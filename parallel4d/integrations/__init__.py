"""Ways into parallel4d from other training stacks (DeepSpeed)."""
