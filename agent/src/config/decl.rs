//! One declaration per configuration key: the [`settings!`] macro turns each table's list of
//! keys (doc comment, name, type, default, range) into the serde struct, its `Default`, the
//! range checks validation runs, and the [`KeyDecl`]s the example file, the man page and the
//! docs' key table are generated from (see `render.rs`).
use std::time::Duration;

use super::{
    keys::KeyPath,
    ranges::{Range, Value},
    size::ByteSize,
    validate::Invalid,
};

/// What the generated documentation says about one key.
#[cfg(test)]
#[derive(Debug, Clone)]
pub(super) struct KeyDecl {
    /// Where the key lives: `agent`, `alerts.severity`, `quota`, `policy.select`.
    pub(super) table: &'static str,
    pub(super) name: &'static str,
    /// The kind of value, as the docs name it.
    pub(super) ty: &'static str,
    /// The allowed values (`100ms to 1h`), for numbers, durations and sizes.
    pub(super) range: Option<String>,
    /// The doc comment's text, one paragraph.
    pub(super) doc: String,
    /// For keys of `[[quota]]`, `[[webhook]]` and `[[policy]]` entries: the value shown in the
    /// example entry.
    pub(super) example: Option<&'static str>,
    /// The default where no value expression states it (entries, computed defaults).
    pub(super) default_is: Option<&'static str>,
    /// Set for a key that moved: where it lives now.
    pub(super) moved_to: Option<&'static str>,
}

#[cfg(test)]
impl KeyDecl {
    /// `table.name`.
    pub(super) fn path(&self) -> String {
        format!("{}.{}", self.table, self.name)
    }
}

/// The doc comment's lines as one paragraph.
#[cfg(test)]
pub(super) fn paragraph(lines: &[&str]) -> String {
    lines
        .iter()
        .flat_map(|l| l.split_whitespace())
        .collect::<Vec<_>>()
        .join(" ")
}

/// A field type that may carry a range: the value it is compared as, when it has one.
pub(super) trait Ranged {
    type V: Value;
    fn ranged(&self) -> Option<Self::V>;
}

impl Ranged for Duration {
    type V = Duration;
    fn ranged(&self) -> Option<Duration> {
        Some(*self)
    }
}
impl Ranged for usize {
    type V = u64;
    fn ranged(&self) -> Option<u64> {
        Some(u64::try_from(*self).unwrap_or(u64::MAX))
    }
}
impl Ranged for u64 {
    type V = u64;
    fn ranged(&self) -> Option<u64> {
        Some(*self)
    }
}
impl Ranged for f64 {
    type V = f64;
    fn ranged(&self) -> Option<f64> {
        Some(*self)
    }
}
impl Ranged for ByteSize {
    type V = ByteSize;
    fn ranged(&self) -> Option<ByteSize> {
        Some(*self)
    }
}
impl<T: Ranged> Ranged for Option<T> {
    type V = T::V;
    fn ranged(&self) -> Option<T::V> {
        self.as_ref().and_then(Ranged::ranged)
    }
}

/// Checks `value` against `range` as key `key` of the table at `table`.
pub(super) fn check<T: Ranged>(
    table: &KeyPath,
    key: &str,
    value: &T,
    range: &Range<T::V>,
) -> Result<(), Invalid> {
    match value.ranged() {
        Some(v) => range.check(table.clone().key(key), v),
        None => Ok(()),
    }
}

/// The range of a field of type `T`, described (the type only picks the value type).
#[cfg(test)]
pub(super) fn describe<T: Ranged>(_: fn() -> Option<T>, range: &Range<T::V>) -> String {
    range.describe()
}

/// How the docs name a field's type.
#[cfg(test)]
pub(super) trait TypeName {
    const NAME: &'static str;
}

macro_rules! type_names {
    ($($t:ty => $n:literal),* $(,)?) => {
        $(#[cfg(test)] impl TypeName for $t { const NAME: &'static str = $n; })*
    };
}
type_names! {
    Duration => "duration",
    usize => "integer",
    u64 => "integer",
    u32 => "integer",
    u16 => "port",
    f64 => "number",
    bool => "boolean",
    String => "string",
    std::net::SocketAddr => "address",
    ByteSize => "size",
    Vec<u16> => "list of ports",
    std::collections::BTreeMap<String, String> => "table of strings",
    std::collections::BTreeMap<String, u16> => "table of ports",
    Vec<crate::table::TcpState> => "list of TCP states",
    crate::logging::LogFormat => "\"text\" or \"json\"",
    super::DestroyMechanism => "\"auto\", \"netlink\" or \"bpf-iter\"",
    super::WebhookFormat => "\"json\" or \"alertmanager\"",
    super::PolicyMode => "\"dry-run\" or \"enforce\"",
    super::Trigger => "\"quota-saturated\" or \"always\"",
    super::Order => "\"oldest-first\"",
    super::Action => "\"destroy\"",
    super::Selector => "inline table",
}
#[cfg(test)]
impl<T: TypeName> TypeName for Option<T> {
    const NAME: &'static str = T::NAME;
}

/// Declares a configuration table: each key once, with its doc comment, optional
/// `#[serde(..)]` attributes, type, default (`= expr`; tables marked `defaults` get a
/// `Default` from them), then any of `range(min, max)`, `example("value")` (the value an
/// entry's example shows), `default_is("text")` (the default in words, where serde computes
/// it), `moved_to("table.key")` (a deprecated location).
///
/// Generates the struct, `Default` (with `defaults`), `fn check_ranges(&self, at)` and
/// `fn keys() -> Vec<KeyDecl>` (for the generated docs). `above(min, max)` is the range
/// `(min, max]`.
macro_rules! settings {
    (@default defaults $name:ident { $($field:ident = $default:expr;)* }) => {
        impl Default for $name {
            fn default() -> Self {
                $name { $($field: $default,)* }
            }
        }
    };
    (@default $name:ident { $($field:ident $(= $default:expr)?;)* }) => {};
    (
        $(#[$meta:meta])*
        $vis:vis struct $name:ident in $table:literal $(, $defaults:ident)? {
            $(
                $(#[doc = $doc:literal])+
                $(#[serde($($attr:tt)*)])*
                $field:ident : $ty:ty $(= $default:expr)?
                $(, range($min:expr, $max:expr))?
                $(, above($amin:expr, $amax:expr))?
                $(, example($example:literal))?
                $(, default_is($default_is:literal))?
                $(, moved_to($moved_to:literal))?
                ;
            )*
        }
    ) => {
        $(#[$meta])*
        $vis struct $name {
            $(
                $(#[doc = $doc])+
                $(#[serde($($attr)*)])*
                pub $field: $ty,
            )*
        }

        $crate::config::decl::settings!(@default $($defaults)? $name { $($field $(= $default)?;)* });

        impl $name {
            /// The table's keys, in the order the example file shows them.
            #[cfg(test)]
            pub(super) fn keys() -> Vec<$crate::config::decl::KeyDecl> {
                use $crate::config::decl::{paragraph, TypeName};
                vec![$(
                    $crate::config::decl::KeyDecl {
                        table: $table,
                        name: stringify!($field),
                        ty: <$ty as TypeName>::NAME,
                        range: None $(.or(Some($crate::config::decl::describe(
                            || None::<$ty>,
                            &$crate::config::ranges::Range::closed($min, $max),
                        ))))? $(.or(Some($crate::config::decl::describe(
                            || None::<$ty>,
                            &$crate::config::ranges::Range::above($amin, $amax),
                        ))))?,
                        doc: paragraph(&[$($doc),+]),
                        example: None $(.or(Some($example)))?,
                        default_is: None $(.or(Some($default_is)))?,
                        moved_to: None $(.or(Some($moved_to)))?,
                    },
                )*]
            }

            /// Every value with a range in it (`at`: this table's path).
            #[allow(unused_variables)]
            pub(super) fn check_ranges(
                &self,
                at: &$crate::config::keys::KeyPath,
            ) -> Result<(), $crate::config::validate::Invalid> {
                $($(
                    $crate::config::decl::check(
                        at,
                        stringify!($field),
                        &self.$field,
                        &$crate::config::ranges::Range::closed($min, $max),
                    )?;
                )? $(
                    $crate::config::decl::check(
                        at,
                        stringify!($field),
                        &self.$field,
                        &$crate::config::ranges::Range::above($amin, $amax),
                    )?;
                )?)*
                Ok(())
            }
        }
    };
}
pub(super) use settings;
