from trireme.cpu_threads import choose_cpu_threads


def test_an_invalid_omp_num_threads_is_named_as_ignored():
    """OMP_NUM_THREADS=abc (or 0) is ignored by torch, which then took every core, while the
    start line said the threads came from OMP_NUM_THREADS=abc; now the cores are shared as
    without it, and the line says the value was ignored."""
    for value in ("abc", "0", " "):
        threads, why = choose_cpu_threads(8, 2, value, 0)
        assert threads == 4
        assert why == (f"OMP_NUM_THREADS={value!r} ignored, not a positive integer; "
                       "8 cores / 2 local processes")
    assert choose_cpu_threads(8, 2, "3", 0) == (None, "OMP_NUM_THREADS=3")


def test_an_openmp_list_or_padded_omp_num_threads_is_obeyed():
    """OpenMP takes a list of counts per nesting level ("1,2": torch ran 1 thread) and spaces
    around a count; such a value was named as ignored and overridden with a share of the
    cores."""
    for value in ("1,2", " 3 ", "4, 1"):
        assert choose_cpu_threads(8, 2, value, 0) == (None, f"OMP_NUM_THREADS={value}")
    for value in ("1,0", "1,", "2abc", "1.5", "\u00b2"):  # (a superscript 2 was a ValueError)
        assert choose_cpu_threads(8, 2, value, 0)[0] == 4
