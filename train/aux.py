"""`python -m train.aux`: the old name of `python -m auxiliary`, kept for one release."""
if __name__ == "__main__":
    import runpy
    runpy.run_module("auxiliary", run_name="__main__", alter_sys=True)
