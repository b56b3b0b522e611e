"""`python -m train.finetune`: the old name of `python -m finetune`, kept for one release."""
if __name__ == "__main__":
    import runpy
    runpy.run_module("finetune", run_name="__main__", alter_sys=True)
