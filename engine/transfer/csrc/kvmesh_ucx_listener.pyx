# cython: language_level=3
# distutils: language = c++
"""A ucxx listener bound to one address.

ucxx's C++ library binds a listener to a host (``ListenerBuilder::host``); its Python binding
only builds wildcard ones. ``create`` mirrors the binding's ``UCXListener.create`` with the host
set, and delivers endpoints to the callback the same way, so the result is an ordinary
``UCXListener`` that ucxx's asyncio ``Listener`` wraps. Built by engine/transfer/listener.py.
"""
import logging
import weakref

from cpython.ref cimport Py_INCREF
from libc.stdint cimport uint16_t, uintptr_t
from libcpp.memory cimport make_unique, shared_ptr, unique_ptr
from libcpp.string cimport string

from ucxx._lib.libucxx cimport UCXListener, UCXWorker
from ucxx._lib.ucxx_api cimport Listener, Worker, ucp_conn_request_h, ucp_listener_conn_callback_t

cdef extern from "<ucxx/listener_builder.h>" namespace "ucxx" nogil:
    cdef cppclass HostListenerBuilder "ucxx::ListenerBuilder":
        HostListenerBuilder(shared_ptr[Worker] worker, uint16_t port,
                            ucp_listener_conn_callback_t callback, void *callback_args) except +
        HostListenerBuilder& host(string host) except +
        shared_ptr[Listener] build() except +

log = logging.getLogger("kvmesh.engine.transfer.listener")


cdef void _on_connection(ucp_conn_request_h conn_request, void *args) noexcept with gil:
    # Runs on ucxx's progress thread; an exception must not cross into C++.
    cdef dict cb_data = <dict> args
    try:
        listener = cb_data["listener"]()
        if listener is None:  # being torn down: UCX rejects the request when the listener goes
            return
        cb_data["cb_func"](listener.create_endpoint_from_conn_request(<uintptr_t> conn_request, True),
                           *cb_data["cb_args"])
    except Exception as e:
        log.error("UCX listener callback failed: %s: %s", type(e).__name__, e)


def create(UCXWorker worker, str host, uint16_t port, cb_func, tuple cb_args):
    """A listener of ``worker`` on ``host``:``port`` (0: any free port) that calls
    ``cb_func(endpoint, *cb_args)`` for each connection. Raises ucxx's error when ``host`` is
    not an address of this machine or the port is taken."""
    cdef UCXListener listener = UCXListener.__new__(UCXListener)
    cdef string c_host = host.encode()
    cdef unique_ptr[HostListenerBuilder] builder
    cdef dict cb_data = {"cb_func": cb_func, "cb_args": cb_args, "listener": weakref.ref(listener)}
    # The C++ listener outlives this object while endpoints it accepted hold it, and a late
    # connection request then still calls back with this dict: it must never be freed (one small
    # dict per listener; a process makes a few), or the callback reads freed memory.
    Py_INCREF(cb_data)
    listener._cb_data = cb_data
    listener._enable_python_future = worker.enable_python_future
    with nogil:
        builder = make_unique[HostListenerBuilder](worker._worker, port, _on_connection, <void*> cb_data)
        builder.get().host(c_host)
        listener._listener = builder.get().build()
    return listener
