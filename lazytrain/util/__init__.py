"""Small utilities every layer may use (atomic writes, sizes, JSON shapes, torch-free checks, local processes).
They import nothing else of LazyTrain."""
