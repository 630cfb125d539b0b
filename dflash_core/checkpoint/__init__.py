"""The checkpoint, owned in one place: what a folder holds (layout.py, checksums.py, the
safetensors and state-tree formats), writing one atomically and loading one (save_load.py), a
run's folders of them (folders.py), the background writers (async_writer.py, writer_loop.py,
staging.py), what a resume loads (resume.py, with the data a checkpoint records: data_identity.py,
data_position.py), and the policy the run calls (checkpointer.py)."""
