"""Measuring this machine and the plans on it: the hardware profile (``profile``, ``profile_collectives``), the
model's own block times (``calibrate``), the CPU step rates (``step_rates``) and the side-by-side benchmark
(``bench``, ``bench_worker``).  Above the core: a measurement runs the runtime and feeds the compiler's profile."""
