"""`python -m open_r1_ext.server --model-path DIR [...]`: start the built-in server (flags in `app.parse_args`)."""

from open_r1_ext.server.app import main

if __name__ == "__main__":
    main()
