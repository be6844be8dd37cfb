"""`python -m kdaserve`: the `kdaserve` command line."""

from kdaserve.cli import main

if __name__ == "__main__":
    main()
