"""Running lynx plans inside other training frameworks (torch only; never imported by the planner)."""
