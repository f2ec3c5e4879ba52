"""How accepted requests reach the backend: per-model ordered queues and the futures
`retrieve_future` answers (scheduler.py), and sample requests started together (coalescer.py)."""
