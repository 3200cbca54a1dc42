"""Pass-through engine flags are read in either spelling (underscores or dashes), as both become one flag."""

from __future__ import annotations

from miles_lite.config.engine_flags import by_flag_name, flag_keys, flag_name, flag_value


def test_either_spelling_reads_the_same_flag() -> None:
    args = {"mem-fraction-static": 0.5, "enable_memory_saver": True, "enable-memory-saver": False}
    assert flag_name("mem-fraction-static") == "mem_fraction_static"
    assert flag_value(args, "mem_fraction_static") == 0.5
    assert flag_keys(args, "enable_memory_saver") == ["enable_memory_saver", "enable-memory-saver"]
    assert flag_value(args, "enable_memory_saver") is False  # the last key spelling it wins
    assert flag_value(args, "ep_size") is None and flag_value(args, "ep_size", 1) == 1
    assert by_flag_name(args) == {"mem_fraction_static": 0.5, "enable_memory_saver": False}
