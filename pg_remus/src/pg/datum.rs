//! Datums: their text form, conversions through it, and copies across memory contexts.

use std::ffi::CStr;

use pgrx::pg_sys;

/// Text form of a datum, through its type's output function.
///
/// # Safety
/// `value` must be a valid datum of type `ty`.
pub unsafe fn datum_to_text(value: pg_sys::Datum, ty: pg_sys::Oid) -> String {
    // SAFETY: the caller upholds this function's `# Safety` contract, on which the pointer
    // and FFI operations below rely.
    unsafe {
        let mut out_fn = pg_sys::InvalidOid;
        let mut varlena = false;
        pg_sys::getTypeOutputInfo(ty, &mut out_fn, &mut varlena);
        let c = pg_sys::OidOutputFunctionCall(out_fn, value);
        CStr::from_ptr(c).to_string_lossy().into_owned()
    }
}

/// Converts a datum between types through their text representations.
///
/// # Safety
/// `value` must be a valid datum of type `from`.
pub unsafe fn coerce_via_text(
    value: pg_sys::Datum,
    from: pg_sys::Oid,
    to: pg_sys::Oid,
) -> pg_sys::Datum {
    // SAFETY: the caller upholds this function's `# Safety` contract, on which the pointer
    // and FFI operations below rely.
    unsafe {
        if from == to {
            return value;
        }
        let mut out_fn = pg_sys::InvalidOid;
        let mut varlena = false;
        pg_sys::getTypeOutputInfo(from, &mut out_fn, &mut varlena);
        let text = pg_sys::OidOutputFunctionCall(out_fn, value);
        let mut in_fn = pg_sys::InvalidOid;
        let mut ioparam = pg_sys::InvalidOid;
        pg_sys::getTypeInputInfo(to, &mut in_fn, &mut ioparam);
        pg_sys::OidInputFunctionCall(in_fn, text, ioparam, -1)
    }
}

/// A copy of a datum in the current memory context (PostgreSQL's datumCopy is not exported to
/// extensions through pgrx's bindings).
///
/// # Safety
/// `d` must be a valid datum of a type with `byval` and `len` (its `attbyval` / `attlen`).
pub(crate) unsafe fn copy_datum(d: pg_sys::Datum, byval: bool, len: i16) -> pg_sys::Datum {
    // SAFETY: the caller upholds this function's `# Safety` contract, on which the pointer
    // and FFI operations below rely.
    unsafe {
        if byval {
            return d;
        }
        let src = d.cast_mut_ptr::<u8>();
        match len {
            -1 => pg_sys::Datum::from(pg_sys::pg_detoast_datum_copy(src as *mut pg_sys::varlena)),
            -2 => pg_sys::Datum::from(pg_sys::pstrdup(src as *const std::ffi::c_char)),
            n => {
                let dst = pg_sys::palloc(n as usize) as *mut u8;
                std::ptr::copy_nonoverlapping(src, dst, n as usize);
                pg_sys::Datum::from(dst)
            }
        }
    }
}

/// Runs `f` with the settings under which the text that output functions write reads the same
/// on every node (a remote session reads it with `datestyle=ISO`, `intervalstyle=postgres`):
/// the client's own DateStyle, IntervalStyle or extra_float_digits would otherwise change what
/// the other node reads (`06/12/2026` is June 12 there), and its search_path how names print.
/// A setting whose value already writes the portable text is left alone (at their defaults all
/// but search_path do): each change costs a GUC save and restore, and DateStyle and
/// IntervalStyle are reported to the client when they change, on every routed statement.
pub(crate) fn with_portable_settings<R>(f: impl FnOnce() -> R) -> R {
    // SAFETY: reads this backend's GUC variables; GUCs set at a new nest level and restored
    // right after, around `f`.
    unsafe {
        let nest = pg_sys::NewGUCNestLevel();
        // ISO output ignores the date order; any extra_float_digits above 0 selects the
        // shortest exact float text, the same as 3.
        for (name, value, needed) in [
            (c"search_path", c"pg_catalog", true),
            (
                c"datestyle",
                c"ISO",
                pg_sys::DateStyle != pg_sys::USE_ISO_DATES as i32,
            ),
            (
                c"intervalstyle",
                c"postgres",
                pg_sys::IntervalStyle != pg_sys::INTSTYLE_POSTGRES as i32,
            ),
            (c"extra_float_digits", c"3", pg_sys::extra_float_digits <= 0),
        ] {
            if !needed {
                continue;
            }
            pg_sys::set_config_option(
                name.as_ptr(),
                value.as_ptr(),
                pg_sys::GucContext::PGC_USERSET,
                pg_sys::GucSource::PGC_S_SESSION,
                pg_sys::GucAction::GUC_ACTION_SAVE,
                true,
                0,
                false,
            );
        }
        let r = f();
        pg_sys::AtEOXact_GUC(true, nest);
        r
    }
}

#[cfg(any(test, feature = "pg_test"))]
#[pgrx::pg_schema]
mod tests {
    use pgrx::prelude::*;

    fn show(name: &str) -> String {
        Spi::get_one::<String>(&format!("SHOW {name}"))
            .unwrap()
            .unwrap()
    }

    /// Values written under the portable settings are the same text whatever the session's
    /// DateStyle, IntervalStyle and extra_float_digits, whether those needed changing or not,
    /// and the session's own settings are back afterwards.
    #[pg_test]
    fn values_are_written_the_same_whatever_the_session_settings() {
        for (datestyle, intervalstyle, digits) in [
            ("ISO, MDY", "postgres", "1"),
            ("SQL, DMY", "sql_standard", "-3"),
            ("German, DMY", "iso_8601", "0"),
            ("ISO, DMY", "postgres_verbose", "2"),
        ] {
            Spi::run(&format!("SET datestyle = '{datestyle}'")).unwrap();
            Spi::run(&format!("SET intervalstyle = '{intervalstyle}'")).unwrap();
            Spi::run(&format!("SET extra_float_digits = {digits}")).unwrap();
            let text = super::with_portable_settings(|| {
                Spi::get_one::<String>(
                    "SELECT format('%s | %s | %s | %s', date '2026-01-08',
                                   interval '1 day 02:03:04', 0.1::float8,
                                   timestamp '2026-01-08 10:00')",
                )
            });
            assert_eq!(
                text.unwrap().as_deref(),
                Some("2026-01-08 | 1 day 02:03:04 | 0.1 | 2026-01-08 10:00:00"),
                "under {datestyle} / {intervalstyle} / {digits}"
            );
            assert_eq!(show("datestyle"), datestyle);
            assert_eq!(show("intervalstyle"), intervalstyle);
            assert_eq!(show("extra_float_digits"), digits);
        }
    }
}
