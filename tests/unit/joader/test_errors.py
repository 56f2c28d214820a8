"""joader's errors: one base class, each error also a builtin, one table to gRPC status codes,
and the way back from a server's status to the class the server raised."""

from __future__ import annotations

import inspect

import pytest

from joader import errors
from joader.errors import ERROR_CLASSES, JoaderError, error_from_status, status_code_name

# gRPC's canonical status codes (the spec's names; grpc itself is not imported in the pytest
# process, which forks decode workers in other tests).
GRPC_CODES = ("OK", "CANCELLED", "UNKNOWN", "INVALID_ARGUMENT", "DEADLINE_EXCEEDED", "NOT_FOUND",
              "ALREADY_EXISTS", "PERMISSION_DENIED", "RESOURCE_EXHAUSTED", "FAILED_PRECONDITION",
              "ABORTED", "OUT_OF_RANGE", "UNIMPLEMENTED", "INTERNAL", "UNAVAILABLE", "DATA_LOSS",
              "UNAUTHENTICATED")
DEFINED = [cls for _, cls in inspect.getmembers(errors, inspect.isclass)
           if issubclass(cls, JoaderError) and cls.__module__ == errors.__name__]


def test_every_error_defined_is_in_the_table_under_its_own_name() -> None:
    assert sorted(c.__name__ for c in DEFINED) == sorted(ERROR_CLASSES)
    assert all(ERROR_CLASSES[c.__name__] is c for c in DEFINED)


# DecodeError is the one exception: it derives from no builtin (noted, not changed here: giving it
# one would change which of a user's except clauses catch it).
@pytest.mark.parametrize("cls", [c for c in DEFINED if c not in (JoaderError, errors.DecodeError)],
                         ids=lambda c: c.__name__)
def test_each_error_is_also_a_builtin_so_plain_except_clauses_catch_it(cls: type[JoaderError]) -> None:
    builtins = [base for base in cls.__mro__[1:]
                if base.__module__ == "builtins" and base not in (Exception, BaseException, object)]
    assert builtins, f"{cls.__name__} derives from no builtin error besides Exception"


@pytest.mark.parametrize("cls", DEFINED, ids=lambda c: c.__name__)
def test_each_status_code_is_a_grpc_code_and_the_class_comes_back_by_name(cls: type[JoaderError]) -> None:
    error = cls("the problem; the fix")
    assert status_code_name(error) in GRPC_CODES
    back = error_from_status(cls.__name__, status_code_name(error), str(error))
    assert type(back) is cls and str(back) == "the problem; the fix"


def test_an_unknown_class_falls_back_to_the_status_code_then_to_the_base() -> None:
    assert type(error_from_status("ErrorOfANewerServer", "NOT_FOUND", "gone")).status_code == "NOT_FOUND"
    assert type(error_from_status(None, "INVALID_ARGUMENT", "bad")) is errors.InvalidArgumentError
    unused = next(code for code in GRPC_CODES if all(c.status_code != code for c in DEFINED))
    assert type(error_from_status(None, unused, "?")) is JoaderError


def test_key_errors_print_their_message_unquoted() -> None:
    assert str(errors.UnknownSourceError("no source 'x'; start joaderd with --source x=PATH")) == \
        "no source 'x'; start joaderd with --source x=PATH"
