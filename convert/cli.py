"""The ``glm-pack`` command line. Each verb lives in its own module and registers here.

Every :class:`~glm_pack.packing.errors.GlmPackError` becomes one line on stderr and exit code 1;
``--debug`` shows the traceback instead. Ctrl-C ends any command with one line and exit code 130, SIGTERM the same
way with exit code 143 (``convert`` says there what the interrupted run left; ``push``, how many files it committed).
"""

from __future__ import annotations

import sys

import click

from glm_pack.packing.errors import GlmPackError

from .interrupts import sigterm_as_interrupt, stopped_how


class _Group(click.Group):
    def invoke(self, ctx):
        try:
            with sigterm_as_interrupt():
                return super().invoke(ctx)
        except GlmPackError as err:
            if ctx.params.get("debug"):
                raise
            click.echo(f"glm-pack: error: {err}", err=True)
            stop = err.__context__  # push's error for a Ctrl-C or SIGTERM
            sys.exit(stopped_how(stop)[1] if isinstance(stop, KeyboardInterrupt) else 1)
        except KeyboardInterrupt as err:  # click's own handling says 'Aborted!' and exits 1
            word, code = stopped_how(err)
            click.echo(f"glm-pack: {word}; {ctx.invoked_subcommand or 'the command'} did not finish", err=True)
            sys.exit(code)


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--debug", is_flag=True, help="Show tracebacks instead of one-line errors.")
@click.version_option(package_name="glm-pack")
def main(debug: bool) -> None:
    """Prepare GLM MLA checkpoints for AMD gfx950 serving: absorb, quantize, re-lay, verify, push."""


def _register() -> None:
    from .commands import convert_command, demo_command, verify_command
    from .inspect import inspect_command
    from .push_commands import card_command, push_command
    from .synth import synth_command

    for command in (
        synth_command,
        inspect_command,
        convert_command,
        verify_command,
        card_command,
        push_command,
        demo_command,
    ):
        main.add_command(command)


_register()


if __name__ == "__main__":
    main()
