//! `List` and `Node` helpers: iterating pointer lists and checking node tags.

use pgrx::pg_sys;

/// Iterates a PostgreSQL `List` of pointers.
///
/// # Safety
/// `list` must be NIL or a valid pointer List whose cells point at `T`.
pub unsafe fn list_ptrs<T>(list: *mut pg_sys::List) -> Vec<*mut T> {
    // SAFETY: the caller upholds this function's `# Safety` contract, on which the pointer
    // and FFI operations below rely.
    unsafe {
        if list.is_null() {
            return Vec::new();
        }
        let n = (*list).length as usize;
        (0..n)
            .map(|i| (*(*list).elements.add(i)).ptr_value as *mut T)
            .collect()
    }
}

/// The values of a PostgreSQL integer `List`.
///
/// # Safety
/// `list` must be NIL or a valid integer List.
pub(crate) unsafe fn list_ints(list: *mut pg_sys::List) -> Vec<i32> {
    // SAFETY: the caller upholds this function's `# Safety` contract.
    unsafe {
        if list.is_null() {
            return Vec::new();
        }
        let n = (*list).length as usize;
        (0..n)
            .map(|i| (*(*list).elements.add(i)).int_value)
            .collect()
    }
}

/// Is `node` a non-NULL node of type `tag`?
///
/// # Safety
/// `node` must be NULL or point at a valid `Node`.
pub(crate) unsafe fn is_tag(node: *const pg_sys::Node, tag: pg_sys::NodeTag) -> bool {
    // SAFETY: `node` is checked for NULL first; otherwise the caller guarantees a valid Node.
    unsafe { !node.is_null() && (*node).type_ == tag }
}

/// `node` with any `RelabelType` wrappers (binary-compatible casts) taken off.
///
/// # Safety
/// `node` must be NULL or a valid expression node.
pub(crate) unsafe fn strip_relabel(mut node: *mut pg_sys::Node) -> *mut pg_sys::Node {
    // SAFETY: the caller upholds this function's `# Safety` contract, on which the pointer
    // and FFI operations below rely.
    unsafe {
        while is_tag(node, pg_sys::NodeTag::T_RelabelType) {
            node = (*(node as *mut pg_sys::RelabelType)).arg as *mut _;
        }
        node
    }
}
